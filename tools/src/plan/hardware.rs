//! The EC2 Graviton instance types `epserve plan` knows: vCPUs, memory,
//! network, and the DRAM bandwidth and compute each one gets (sources and
//! assumptions next to each number).

use anyhow::{Result, bail};

use super::GIB;

/// Share of an instance's nominal memory the kernel reports as `MemTotal`
/// (the node's capacity in Kubernetes): firmware, the kernel image and its
/// reservations take the rest (assumption: ~3% on Graviton AL2023 nodes).
const NODE_CAPACITY_FRACTION: f64 = 0.97;
/// The kubelet's `reservedSystemCPUs` in deploy/README.md's node configuration
/// ("0-1"): with the static CPU manager these whole cores replace kube-reserved
/// and system-reserved CPU, and are never handed to a Guaranteed pod.
pub const RESERVED_SYSTEM_CPUS: u32 = 2;
/// EKS AL2023's kube-reserved memory: 255 MiB + 11 MiB per pod the node may
/// run (nodeadm, from the VPC CNI's max-pods).
const KUBE_RESERVED_MIB_BASE: f64 = 255.0;
const KUBE_RESERVED_MIB_PER_POD: f64 = 11.0;
/// The kubelet's default hard eviction threshold (`memory.available<100Mi`).
const EVICTION_HARD_MIB: f64 = 100.0;
/// What the DaemonSets an EKS node runs request, summed: kube-proxy (100m),
/// aws-node (25m), ebs-csi-node (3 × 10m, 3 × 40Mi), eks-pod-identity-agent
/// (25m) — 180m and 120Mi — rounded up for one more agent (a log shipper or
/// the CloudWatch agent): 250m CPU and 256 MiB.
pub const DAEMONSET_CPU_MILLIS: u32 = 250;
pub const DAEMONSET_MEMORY_MIB: u32 = 256;
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
    /// An EKS node (kubelet reservations and DaemonSets apply); false for
    /// `--instance local`, this machine running `epserve up`.
    pub managed: bool,
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
                    managed: true,
                });
            }
        }
        out
    }

    /// This machine as one node of a loopback cluster (`epserve up`): its
    /// vCPUs and memory, no kubelet; bandwidth and compute must come from
    /// `--calibration` (the Graviton figures stay as placeholders until then),
    /// the network is loopback (memory copies: taken as 100 Gbps).
    pub fn local() -> Result<Instance> {
        let vcpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if kib <= 0.0 {
            bail!("--instance local: cannot read MemTotal from /proc/meminfo");
        }
        Ok(Instance {
            name: "local".into(),
            family: "local",
            size: "local",
            generation: Generation {
                name: "this machine",
                cores_per_socket: vcpus,
                ..GRAVITON4
            },
            vcpus,
            mem_gib: kib / (1024.0 * 1024.0),
            net_gbps: 100.0,
            managed: false,
        })
    }

    /// Looks an instance type up by name (`c8g.16xlarge`, or `local`).
    pub fn lookup(name: &str) -> Result<Instance> {
        if name == "local" {
            return Self::local();
        }
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

    /// CPU sockets (NUMA nodes): the 48xlarge and metal-48xl Graviton4 sizes
    /// span two.
    pub fn sockets(&self) -> u32 {
        self.vcpus.div_ceil(self.generation.cores_per_socket).max(1)
    }

    /// Pods the node may run: the VPC CNI's max-pods, `ENIs × (IPv4 per ENI − 1) + 2`,
    /// from the EC2 network limits of Graviton sizes (4xlarge to 12xlarge: 8 ENIs
    /// of 30 addresses; 16xlarge and larger: 15 of 50).
    pub fn max_pods(&self) -> u32 {
        let (enis, ips) = match self.vcpus {
            0..=1 => (2, 4),
            2 => (3, 10),
            3..=8 => (4, 15),
            9..=48 => (8, 30),
            _ => (15, 50),
        };
        enis * (ips - 1) + 2
    }

    /// The node's allocatable CPU in millicores: capacity less the
    /// `reservedSystemCPUs` of deploy/README.md's kubelet configuration.
    pub fn allocatable_cpu_millis(&self) -> u32 {
        self.vcpus
            .saturating_sub(RESERVED_SYSTEM_CPUS.min(self.vcpus / 2))
            * 1000
    }

    /// The node's allocatable memory in MiB: `MemTotal` less EKS's
    /// kube-reserved memory and the eviction threshold.
    pub fn allocatable_memory_mib(&self) -> f64 {
        let capacity = self.mem_gib * 1024.0 * NODE_CAPACITY_FRACTION;
        let kube = KUBE_RESERVED_MIB_BASE + KUBE_RESERVED_MIB_PER_POD * f64::from(self.max_pods());
        (capacity - kube - EVICTION_HARD_MIB).max(0.0)
    }

    /// vCPUs a Guaranteed pod (integer CPUs) can request on a node of this
    /// type next to the DaemonSets: what allocatable leaves after their
    /// requests, rounded down to whole CPUs.
    pub fn pod_cpus(&self) -> u32 {
        if !self.managed {
            return self.vcpus;
        }
        (self
            .allocatable_cpu_millis()
            .saturating_sub(DAEMONSET_CPU_MILLIS)
            / 1000)
            .max(1)
    }

    /// GiB of memory a pod can request on a node of this type next to the
    /// DaemonSets (whole GiB).
    pub fn pod_memory_gib(&self) -> u64 {
        if !self.managed {
            return (self.mem_gib * 0.9).floor() as u64;
        }
        ((self.allocatable_memory_mib() - f64::from(DAEMONSET_MEMORY_MIB)).max(0.0) / 1024.0)
            .floor() as u64
    }

    /// Bytes of a pod on this node available to weights and KV cache.
    pub fn pod_budget_bytes(&self) -> f64 {
        (self.pod_memory_gib() as f64 * GIB - POD_OVERHEAD_BYTES).max(0.0)
    }
}

/// The node model every pod size of `epserve plan` and the Helm chart's test
/// rest on, as JSON (`epserve plan --node-model`): per instance type its
/// capacity, allocatable and what one Guaranteed pod can request next to the
/// DaemonSets.
pub fn node_model_json() -> serde_json::Value {
    let instances: Vec<serde_json::Value> = Instance::all()
        .iter()
        .map(|i| {
            serde_json::json!({
                "name": i.name,
                "vcpus": i.vcpus,
                "memory_gib": i.mem_gib,
                "max_pods": i.max_pods(),
                "allocatable_cpu_millis": i.allocatable_cpu_millis(),
                "allocatable_memory_mib": i.allocatable_memory_mib().floor(),
                "pod_cpus": i.pod_cpus(),
                "pod_memory_gib": i.pod_memory_gib(),
            })
        })
        .collect();
    serde_json::json!({
        "assumptions": {
            "reserved_system_cpus": RESERVED_SYSTEM_CPUS,
            "memtotal_fraction": NODE_CAPACITY_FRACTION,
            "kube_reserved_memory_mib": format!("{KUBE_RESERVED_MIB_BASE} + {KUBE_RESERVED_MIB_PER_POD} x max_pods"),
            "eviction_hard_mib": EVICTION_HARD_MIB,
            "daemonset_cpu_millis": DAEMONSET_CPU_MILLIS,
            "daemonset_memory_mib": DAEMONSET_MEMORY_MIB,
        },
        "instances": instances,
    })
}
