//! What `epserve plan` prints, and the Helm values file it writes.

use std::fmt::Write as _;

use super::{Assumptions, GIB, Instance, ModelShape, Plan, PlanArgs};

const MIB: f64 = 1024.0 * 1024.0;

fn human_params(p: u64) -> String {
    let p = p as f64;
    if p >= 1e9 {
        format!("{:.2} B", p / 1e9)
    } else {
        format!("{:.1} M", p / 1e6)
    }
}

fn human_bytes(b: f64) -> String {
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else if b >= MIB {
        format!("{:.2} MiB", b / MIB)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

/// The report `epserve plan` prints.
pub fn render_report(
    m: &ModelShape,
    inst: &Instance,
    a: &Assumptions,
    plan: &Plan,
    target_tps: f64,
    batch: u64,
) -> String {
    let mut s = String::new();
    let ed = a.expert_dtype;
    let _ = writeln!(
        s,
        "model       {}: {} layers ({} MoE), {} experts, top-{}, hidden {}, expert width {}, {} heads / {} KV heads x {}",
        m.model_type,
        m.layers,
        m.moe_layers,
        m.experts,
        m.top_k,
        m.hidden,
        m.moe_width,
        m.heads,
        m.kv_heads,
        m.head_dim
    );
    let _ = writeln!(
        s,
        "parameters  {} total, {} active per token; one expert {} ({}); all experts {}; other weights {} (bf16)",
        human_params(m.total_params()),
        human_params(m.active_params()),
        human_bytes(m.expert_bytes(ed) as f64),
        ed.name(),
        human_bytes((m.moe_layers * m.experts * m.expert_bytes(ed)) as f64),
        human_bytes(2.0 * m.non_expert_params() as f64),
    );
    let _ = writeln!(
        s,
        "KV cache    {} per token ({}); {} for {} sequences of {} tokens",
        human_bytes(m.kv_bytes_per_token(a.kv_dtype) as f64),
        a.kv_dtype.name(),
        human_bytes(plan.kv_pool_bytes),
        batch,
        a.context_len
    );
    let _ = writeln!(
        s,
        "instance    {}: {} vCPU ({}), {} GiB, {:.1} GB/s peak memory bandwidth ({:.1} used at {:.0}%), {} Gbps network; pods get {} vCPU, {} GiB",
        inst.name,
        inst.vcpus,
        inst.generation.name,
        inst.mem_gib,
        inst.peak_bandwidth() / 1e9,
        inst.peak_bandwidth() * a.mem_bw_efficiency / 1e9,
        a.mem_bw_efficiency * 100.0,
        inst.net_gbps,
        inst.pod_cpus(),
        inst.pod_memory_gib()
    );
    if inst.sockets() > 1 {
        let _ = writeln!(
            s,
            "NUMA        {} sockets per node: one expert-worker pod per socket ({} CPUs, {} GiB each; kubelet topologyManagerPolicy restricted keeps each on its NUMA node), {} pods per node",
            inst.sockets(),
            inst.pod_cpus() / inst.sockets(),
            inst.pod_memory_gib() / u64::from(inst.sockets()),
            inst.sockets()
        );
    }
    let _ = writeln!(s);
    let l = plan.layout;
    let _ = writeln!(
        s,
        "plan        {} expert-worker(s), {} attention-worker(s){}, 1 coordinator: {} {} nodes",
        l.expert_workers,
        l.attention_workers,
        if l.attention_workers == 0 {
            " (attention in the coordinator)"
        } else {
            ""
        },
        l.expert_workers + l.attention_workers + 1,
        inst.name
    );
    let _ = writeln!(
        s,
        "experts     {} slots per worker per layer (room for {}), {} experts per layer over {} worker(s): {} redundant slot(s) per layer for hot experts; {} of experts per worker",
        plan.slots_per_worker,
        plan.slot_capacity,
        m.experts,
        l.expert_workers,
        plan.redundant_per_layer,
        human_bytes(plan.worker_expert_bytes)
    );
    if plan.held_fraction < 1.0 {
        let e = &plan.at_batch;
        let _ = writeln!(
            s,
            "cold tier   the experts need {} expert-workers; capped at {} (--max-expert-workers), each holds {} of its {} experts per layer packed \
             (--expert-memory {}, the hottest: {:.0}% of each layer's experts held); the rest are read from disk at {:.1} GB/s and packed on use. \
             At batch {}: {:.1}% of expert uses hit (Zipf {}), {:.1} ms per step reading and packing",
            m.experts.div_ceil(plan.slot_capacity.max(1)),
            l.expert_workers,
            plan.slot_capacity,
            plan.slots_per_worker,
            human_bytes(plan.worker_expert_bytes),
            plan.held_fraction * 100.0,
            a.cold.read_bps / 1e9,
            batch,
            e.hit_rate * 100.0,
            a.cold.zipf,
            e.cold_s * 1e3
        );
    }
    let _ = writeln!(
        s,
        "memory      coordinator {}{}",
        human_bytes(plan.coordinator_bytes),
        if l.attention_workers > 0 {
            format!(", each attention shard {}", human_bytes(plan.shard_bytes))
        } else {
            String::new()
        }
    );
    let e = &plan.at_batch;
    if plan.reachable {
        let _ = writeln!(
            s,
            "target      {target_tps:.0} output tok/s: reached at batch {batch}: {:.0} tok/s ({:.1} ms per step, bound by {})",
            e.tokens_per_s(),
            e.step_s() * 1e3,
            e.bound()
        );
    } else {
        let _ = writeln!(
            s,
            "target      {target_tps:.0} output tok/s: NOT reached by one coordinator at batch {batch}: {:.0} tok/s at best ({:.1} ms per step, bound by {}); run {} such deployments, or raise --batch",
            e.tokens_per_s(),
            e.step_s() * 1e3,
            e.bound(),
            plan.deployments
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "decode throughput by batch size (one coordinator, stages in sequence; ms per step)"
    );
    let _ = writeln!(
        s,
        "{:>6} {:>9} {:>11} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>10}  bound",
        "batch",
        "experts/L",
        "GB/step",
        "coord",
        "attn",
        "experts",
        "network",
        "rtt",
        "cold",
        "step",
        "tok/s"
    );
    for e in &plan.table {
        let _ = writeln!(
            s,
            "{:>6} {:>9.1} {:>11.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>10.0}  {}",
            e.batch,
            e.experts_touched,
            e.bytes_streamed / 1e9,
            e.coordinator_s * 1e3,
            e.attention_s * 1e3,
            e.experts_s * 1e3,
            e.network_s * 1e3,
            e.latency_s * 1e3,
            e.cold_s * 1e3,
            e.step_s() * 1e3,
            e.tokens_per_s(),
            e.bound()
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "assumptions: uniform routing, balanced placement, no overlap of stages, {:.0} us per round trip, \
         {} activations on the wire (one combined vector per token back from each worker), {:.0} Gbps per TCP flow \
         (one per worker), bandwidth shared by vCPU share of the socket, {} GFLOP/s bf16 per vCPU sustained, context {} tokens.",
        a.rtt_s * 1e6,
        a.wire_dtype.name(),
        a.flow_bps / 1e9,
        inst.generation.gflops_bf16_per_vcpu,
        a.context_len
    );
    s
}

/// A values file for deploy/helm/epserve that applies the plan.
pub fn helm_values(
    m: &ModelShape,
    inst: &Instance,
    a: &Assumptions,
    plan: &Plan,
    args: &PlanArgs,
) -> String {
    let l = plan.layout;
    let cpus = inst.pod_cpus();
    let mem = inst.pod_memory_gib();
    let kv_gib = (plan.kv_pool_bytes / GIB).ceil().max(1.0) as u64;
    let model = args
        .model
        .as_deref()
        .unwrap_or(std::path::Path::new("model"));
    let folder = model
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let yaml_str = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let mut s = String::new();
    let _ = writeln!(s, "# Generated by:");
    let _ = writeln!(
        s,
        "#   epserve plan --model {} --instance {} --target-output-tps {}",
        model.display(),
        inst.name,
        args.target_output_tps.unwrap_or(0.0)
    );
    let _ = writeln!(
        s,
        "#     --expert-dtype {} --kv-dtype {} --batch {} --context-len {}",
        a.expert_dtype.name(),
        a.kv_dtype.name(),
        args.batch,
        a.context_len
    );
    let _ = writeln!(
        s,
        "# {} ({} layers, {} experts, top-{}): expected {:.0} output tok/s at batch {} ({}).",
        m.model_type,
        m.layers,
        m.experts,
        m.top_k,
        plan.at_batch.tokens_per_s(),
        args.batch,
        if plan.reachable {
            "target reached"
        } else {
            "target NOT reached by one deployment"
        }
    );
    let _ = writeln!(
        s,
        "# {} slots per expert-worker per layer, {} redundant per layer; experts stored as {}.",
        plan.slots_per_worker,
        plan.redundant_per_layer,
        a.expert_dtype.name()
    );
    let _ = writeln!(
        s,
        "# Layer it on the chart's values: helm install ... -f values.yaml -f THIS_FILE"
    );
    let _ = writeln!(s, "model:");
    let _ = writeln!(
        s,
        "  # -- Folder inside the model volume (set the source in your own values)."
    );
    let _ = writeln!(s, "  path: {}", yaml_str(&folder));
    let _ = writeln!(s, "scheduling:");
    let _ = writeln!(s, "  # -- Every pod on {} nodes.", inst.name);
    let _ = writeln!(s, "  instanceFamilies: [{}]", inst.family);
    let _ = writeln!(
        s,
        "  # -- Crossed with the families into node.kubernetes.io/instance-type."
    );
    let _ = writeln!(s, "  instanceSizes: [{}]", yaml_str(inst.size));
    let _ = writeln!(s, "coordinator:");
    let _ = writeln!(
        s,
        "  # -- Wait for every planned expert-worker before the first placement (their memory holds the experts)."
    );
    let _ = writeln!(
        s,
        "  minExpertWorkers: {}",
        l.expert_workers * u64::from(inst.sockets())
    );
    let _ = writeln!(s, "  # -- The operating batch of the plan.");
    let _ = writeln!(s, "  maxNumSeqs: {}", args.batch);
    let _ = writeln!(
        s,
        "  # -- KV pool for {} sequences of {} tokens ({}).",
        args.batch,
        a.context_len,
        a.kv_dtype.name()
    );
    if l.attention_workers == 0 {
        let _ = writeln!(s, "  kvCacheMemory: {kv_gib}GiB");
    } else {
        let _ = writeln!(s, "  kvCacheMemory: \"\"");
    }
    if a.wire_dtype != super::WireDtype::Bf16 {
        let _ = writeln!(
            s,
            "  # -- The plan assumed this activation dtype on the wire."
        );
        let _ = writeln!(s, "  dispatchDtype: {}", a.wire_dtype.name());
    }
    let _ = writeln!(s, "  # -- One coordinator per node.");
    let _ = writeln!(s, "  resources:");
    let _ = writeln!(s, "    cpu: {cpus}");
    let _ = writeln!(s, "    memory: {mem}Gi");
    let _ = writeln!(s, "expertWorkers:");
    let sockets = u64::from(inst.sockets());
    if sockets > 1 {
        // One worker pod per socket: with the static CPU manager and
        // topologyManagerPolicy restricted, a pod of one socket's CPUs gets
        // them (and its memory) from one NUMA node.
        let _ = writeln!(
            s,
            "  # -- {} nodes x {sockets} sockets: one expert-worker pod per socket (NUMA node).",
            l.expert_workers
        );
        let _ = writeln!(s, "  replicas: {}", l.expert_workers * sockets);
        let _ = writeln!(
            s,
            "  # -- {sockets} per node (one per socket), so no hard anti-affinity."
        );
        let _ = writeln!(s, "  antiAffinity: soft");
    } else {
        let _ = writeln!(s, "  # -- Expert-workers, one per node.");
        let _ = writeln!(s, "  replicas: {}", l.expert_workers);
        let _ = writeln!(
            s,
            "  # -- One worker per node: each streams its experts from its own memory."
        );
        let _ = writeln!(s, "  antiAffinity: hard");
    }
    if a.expert_dtype == super::ExpertDtype::Int8 {
        let _ = writeln!(s, "  # -- The plan assumed int8 (W8A8) experts.");
        let _ = writeln!(s, "  expertDtype: int8");
    }
    if plan.held_fraction < 1.0 {
        let _ = writeln!(
            s,
            "  # -- Cold tier: the packed experts each worker holds ({:.0}% of them), the rest packed on use.",
            plan.held_fraction * 100.0
        );
        let _ = writeln!(
            s,
            "  expertMemory: \"{}MiB\"",
            (plan.worker_expert_bytes / sockets as f64 / (1u64 << 20) as f64).floor() as u64
        );
    }
    if sockets > 1 {
        let _ = writeln!(
            s,
            "  # -- One socket of the node but what the kubelet and the DaemonSets keep."
        );
        let _ = writeln!(s, "  resources:");
        let _ = writeln!(s, "    cpu: {}", u64::from(cpus) / sockets);
        let _ = writeln!(s, "    memory: {}Gi", mem / sockets);
    } else {
        let _ = writeln!(
            s,
            "  # -- The whole node but what the kubelet and the DaemonSets keep (Guaranteed QoS, exclusive cores)."
        );
        let _ = writeln!(s, "  resources:");
        let _ = writeln!(s, "    cpu: {cpus}");
        let _ = writeln!(s, "    memory: {mem}Gi");
    }
    let _ = writeln!(s, "attentionWorkers:");
    let _ = writeln!(
        s,
        "  # -- Attention shards ({} KV heads split evenly); 0 = in the coordinator.",
        m.kv_heads
    );
    let _ = writeln!(s, "  replicas: {}", l.attention_workers);
    let _ = writeln!(s, "  # -- One shard per node.");
    let _ = writeln!(s, "  antiAffinity: hard");
    let _ = writeln!(s, "  # -- The whole node but what the kubelet keeps.");
    let _ = writeln!(s, "  resources:");
    let _ = writeln!(s, "    cpu: {cpus}");
    let _ = writeln!(s, "    memory: {mem}Gi");
    s
}
