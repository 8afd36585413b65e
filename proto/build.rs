//! Compiles `epserve/v1/epserve.proto` with tonic/prost using the protoc that
//! the `protoc-bin-vendored` crate ships, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the
    // environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=epserve/v1/epserve.proto");
    // Tensor payloads are `bytes::Bytes`: a decoded message's payload is a
    // slice of the received buffer, and one encoded tensor sent to several
    // peers (the hidden state to every attention shard) is shared, not copied.
    tonic_prost_build::configure()
        .bytes(".epserve.v1.Tensor.data")
        .bytes(".epserve.v1.Tensor.scales")
        .compile_protos(&["epserve/v1/epserve.proto"], &["."])?;
    Ok(())
}
