//! Compiles `epserve/v1/epserve.proto` with tonic/prost using the protoc that
//! the `protoc-bin-vendored` crate ships, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the
    // environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=epserve/v1/epserve.proto");
    tonic_prost_build::configure().compile_protos(&["epserve/v1/epserve.proto"], &["."])?;
    Ok(())
}
