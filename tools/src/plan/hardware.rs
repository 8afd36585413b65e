//! The EC2 Graviton instance types `epserve plan` knows: vCPUs, memory,
//! network, and the DRAM bandwidth and compute each one gets (sources and
//! assumptions next to each number).

use anyhow::{Result, bail};

use super::GIB;

/// Share of an instance's memory a pod may ask for: the rest is the kubelet's,
/// the OS's and the eviction threshold's (EKS reserves ~1-3 GiB on large nodes).
const POD_MEMORY_FRACTION: f64 = 0.9;
/// Memory of a pod not available to weights / KV: runtime, activations,
/// gRPC buffers, page tables.
const POD_OVERHEAD_BYTES: f64 = 4.0 * GIB;

/// A Graviton generation: one socket's cores and peak DRAM bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Generation {
    pub name: &'static str,
    /// Cores (= vCPUs: Graviton has no SMT) of one socket.
    pub cores_per_socket: u32,
    /// Peak DRAM bandwidth of one socket, GB/s (10^9 bytes): channels × MT/s × 8 bytes.
    pub peak_gbs_per_socket: f64,
    /// Sustained bf16 matrix throughput per vCPU, GFLOP/s (assumption, see below).
    pub gflops_bf16_per_vcpu: f64,
    /// Sustained int8 matrix throughput per vCPU, GOP/s (assumption, see below).
    pub gops_int8_per_vcpu: f64,
}

/// Graviton3 (c7g / m7g / r7g): 64 Neoverse V1 cores, 8 channels of DDR5-4800:
/// 8 × 4800 MT/s × 8 B = 307.2 GB/s (AWS: "DDR5, 50% more bandwidth than Graviton2").
/// Compute: V1 has two 256-bit SVE pipes; BFMMLA gives 128 bf16 FLOP/cycle at
/// 2.6 GHz = 333 GFLOP/s peak per core; we assume ~30% of it is sustained in
/// the expert GEMMs (100 GFLOP/s), twice that for int8 (SMMLA has twice the ops).
pub const GRAVITON3: Generation = Generation {
    name: "Graviton3",
    cores_per_socket: 64,
    peak_gbs_per_socket: 307.2,
    gflops_bf16_per_vcpu: 100.0,
    gops_int8_per_vcpu: 200.0,
};

/// Graviton4 (c8g / m8g / r8g): 96 Neoverse V2 cores per socket, 12 channels of
/// DDR5-5600: 12 × 5600 MT/s × 8 B = 537.6 GB/s (AWS: "75% more memory
/// bandwidth than Graviton3"); the 48xlarge / metal-48xl sizes span two sockets.
/// Compute: four 128-bit pipes, BFMMLA 128 bf16 FLOP/cycle at 2.8 GHz = 358 GFLOP/s
/// peak; same ~30% sustained assumption as Graviton3.
pub const GRAVITON4: Generation = Generation {
    name: "Graviton4",
    cores_per_socket: 96,
    peak_gbs_per_socket: 537.6,
    gflops_bf16_per_vcpu: 100.0,
    gops_int8_per_vcpu: 200.0,
};

/// Instance families: generation and GiB of memory per vCPU (c: 2, m: 4, r: 8).
const FAMILIES: [(&str, &Generation, f64); 6] = [
    ("c7g", &GRAVITON3, 2.0),
    ("m7g", &GRAVITON3, 4.0),
    ("r7g", &GRAVITON3, 8.0),
    ("c8g", &GRAVITON4, 2.0),
    ("m8g", &GRAVITON4, 4.0),
    ("r8g", &GRAVITON4, 8.0),
];

/// Sizes of the Graviton3 families: (size, vCPUs, network Gbps). From the EC2
/// instance-type pages; network figures of the small sizes are "up to" (burst).
const SIZES_G3: [(&str, u32, f64); 9] = [
    ("medium", 1, 12.5),
    ("large", 2, 12.5),
    ("xlarge", 4, 12.5),
    ("2xlarge", 8, 15.0),
    ("4xlarge", 16, 15.0),
    ("8xlarge", 32, 15.0),
    ("12xlarge", 48, 22.5),
    ("16xlarge", 64, 30.0),
    ("metal", 64, 30.0),
];

/// Sizes of the Graviton4 families: (size, vCPUs, network Gbps).
const SIZES_G4: [(&str, u32, f64); 12] = [
    ("medium", 1, 12.5),
    ("large", 2, 12.5),
    ("xlarge", 4, 12.5),
    ("2xlarge", 8, 15.0),
    ("4xlarge", 16, 15.0),
    ("8xlarge", 32, 15.0),
    ("12xlarge", 48, 22.5),
    ("16xlarge", 64, 30.0),
    ("24xlarge", 96, 40.0),
    ("48xlarge", 192, 50.0),
    ("metal-24xl", 96, 40.0),
    ("metal-48xl", 192, 50.0),
];

/// One EC2 instance type.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    pub name: String,
    pub family: &'static str,
    pub size: &'static str,
    pub generation: Generation,
    pub vcpus: u32,
    pub mem_gib: f64,
    pub net_gbps: f64,
}

impl Instance {
    /// Every instance type in the tables.
    pub fn all() -> Vec<Instance> {
        let mut out = Vec::new();
        for (family, generation, gib_per_vcpu) in FAMILIES {
            let sizes: &[(&'static str, u32, f64)] = if generation.name == GRAVITON3.name {
                &SIZES_G3
            } else {
                &SIZES_G4
            };
            for &(size, vcpus, net_gbps) in sizes {
                out.push(Instance {
                    name: format!("{family}.{size}"),
                    family,
                    size,
                    generation: *generation,
                    vcpus,
                    mem_gib: f64::from(vcpus) * gib_per_vcpu,
                    net_gbps,
                });
            }
        }
        out
    }

    /// Looks an instance type up by name (`c8g.16xlarge`).
    pub fn lookup(name: &str) -> Result<Instance> {
        let all = Self::all();
        if let Some(i) = all.iter().find(|i| i.name == name) {
            return Ok(i.clone());
        }
        let families: Vec<&str> = FAMILIES.iter().map(|f| f.0).collect();
        bail!(
            "unknown instance type '{name}': expected <family>.<size> with family one of {} (e.g. c8g.16xlarge)",
            families.join(", ")
        )
    }

    /// Peak DRAM bandwidth this instance gets, bytes/s. Assumption: a VM with n
    /// of a socket's cores gets n/cores of the socket's bandwidth (AWS does not
    /// publish per-size figures); 48xlarge sizes get two sockets.
    pub fn peak_bandwidth(&self) -> f64 {
        self.generation.peak_gbs_per_socket * 1e9 * f64::from(self.vcpus)
            / f64::from(self.generation.cores_per_socket)
    }

    /// vCPUs a Guaranteed pod can request on a node of this type: the kubelet,
    /// system daemons and DaemonSets keep 1 (small nodes) or 2 vCPUs.
    pub fn pod_cpus(&self) -> u32 {
        if self.vcpus >= 16 {
            self.vcpus - 2
        } else {
            self.vcpus.saturating_sub(1).max(1)
        }
    }

    /// GiB of memory a pod can request on a node of this type (whole GiB).
    pub fn pod_memory_gib(&self) -> u64 {
        (self.mem_gib * POD_MEMORY_FRACTION).floor() as u64
    }

    /// Bytes of a pod on this node available to weights and KV cache.
    pub fn pod_budget_bytes(&self) -> f64 {
        (self.pod_memory_gib() as f64 * GIB - POD_OVERHEAD_BYTES).max(0.0)
    }
}
