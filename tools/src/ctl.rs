//! `epserve ctl`: the admin client. Talks to the coordinator's admin gRPC
//! service (bearer token from `--token` / `EPSERVE_ADMIN_TOKEN`) and prints
//! human tables, or one JSON document with `--json`. `load` draws a per-layer
//! heat map of expert load in the terminal and, with `--png`, as a picture.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use epserve_proto::pb::admin_service_client::AdminServiceClient;
use epserve_proto::pb::{
    DrainWorkerRequest, GetExpertLoadRequest, GetExpertLoadResponse, GetPlacementRequest,
    GetRebalanceRequest, ListWorkersRequest, RebalanceRequest, RebalanceResponse,
    SetPlacementRequest,
};
use serde_json::{Value, json};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// `epserve ctl`.
#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The coordinator's admin gRPC address (`HOST:PORT` or a URL).
    #[arg(
        long,
        env = "EPSERVE_ADMIN",
        default_value = "127.0.0.1:9000",
        global = true
    )]
    pub admin: String,
    /// Bearer token of the admin service.
    #[arg(
        long,
        env = "EPSERVE_ADMIN_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
    /// Print one JSON document instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Mutual TLS to the admin service (before the subcommand): the
    /// coordinator's certificate must name the --admin host.
    #[command(flatten)]
    pub tls: epserve_cluster::tls::NodeTlsArgs,
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// `epserve ctl` subcommands.
#[derive(Debug, Subcommand)]
pub enum CtlCommand {
    /// The placement in force: experts per worker and layer.
    Placement,
    /// Expert load over the coordinator's window: a heat map per layer,
    /// per-worker tokens and balancedness.
    Load {
        /// Also write the heat map as a PNG picture (layers x experts).
        #[arg(long, value_name = "FILE")]
        png: Option<PathBuf>,
    },
    /// Registered workers and the experts each holds.
    Workers,
    /// Plan a placement from the measured load (EPLB) and apply it live.
    Rebalance {
        /// Only show predicted vs current balancedness; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Extra replicas per MoE layer for the hottest experts.
        #[arg(long, default_value_t = 0)]
        redundant: u32,
        /// Most experts of one layer per worker (0 = as few as fit).
        #[arg(long, default_value_t = 0)]
        capacity: u32,
        /// Apply only if the mean predicted balancedness rises by this much.
        #[arg(long, default_value_t = 0.0)]
        min_improvement: f64,
    },
    /// Move every expert off a worker (live) so it can be stopped.
    Drain {
        /// Worker id (as `ctl workers` lists it).
        worker: String,
        #[arg(long)]
        dry_run: bool,
    },
    /// Apply an explicit placement from a JSON file (as `ctl placement --json` prints it).
    SetPlacement {
        file: PathBuf,
        #[arg(long)]
        dry_run: bool,
    },
    /// The live rebalance in progress or last finished.
    Status,
}

type Auth = Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;
type Client = AdminServiceClient<InterceptedService<Channel, Auth>>;

async fn connect(args: &CtlArgs) -> Result<Client> {
    let tls = args.tls.load()?;
    let url = epserve_cluster::tls::node_url(&args.admin, tls.is_some());
    let channel = epserve_cluster::tls::endpoint(&args.admin, tls.as_ref())
        .with_context(|| format!("--admin {}", args.admin))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot reach the admin service at {url}: {}",
                epserve_cluster::tls::error_chain(&e)
            )
        })?;
    let header: Option<MetadataValue<_>> = match args.token.as_deref().filter(|t| !t.is_empty()) {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .context("--token: not a valid header value")?,
        ),
        None => None,
    };
    let f: Auth = Box::new(move |mut r: tonic::Request<()>| {
        if let Some(h) = &header {
            r.metadata_mut().insert("authorization", h.clone());
        }
        Ok(r)
    });
    Ok(AdminServiceClient::with_interceptor(channel, f).max_decoding_message_size(256 << 20))
}

fn rpc_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!(
        "admin service: {:?}: {}",
        s.code(),
        epserve_cluster::tls::status_why(&s)
    )
}

/// Runs `epserve ctl` (blocking).
pub fn run(args: &CtlArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(run_async(args))
}

async fn run_async(args: &CtlArgs) -> Result<()> {
    let mut c = connect(args).await?;
    match &args.command {
        CtlCommand::Placement => {
            let r = c
                .get_placement(GetPlacementRequest {})
                .await
                .map_err(rpc_err)?
                .into_inner();
            let p: Value = serde_json::from_str(&r.placement_json)
                .context("the coordinator sent a corrupt placement")?;
            if args.json {
                println!("{p}");
            } else {
                print!("{}", placement_table(&p));
            }
        }
        CtlCommand::Workers => {
            let r = c
                .list_workers(ListWorkersRequest {})
                .await
                .map_err(rpc_err)?
                .into_inner();
            if args.json {
                let v: Vec<Value> = r
                    .workers
                    .iter()
                    .map(|w| {
                        json!({"id": w.id, "role": w.role, "addr": w.addr, "cores": w.cores,
                               "memory_bytes": w.memory_bytes, "experts": w.experts})
                    })
                    .collect();
                println!("{}", Value::Array(v));
            } else {
                let mut rows = vec![vec![
                    "ID".to_string(),
                    "ROLE".into(),
                    "ADDRESS".into(),
                    "EXPERTS".into(),
                    "CORES".into(),
                    "MEMORY".into(),
                ]];
                for w in &r.workers {
                    rows.push(vec![
                        w.id.clone(),
                        w.role.clone(),
                        w.addr.clone(),
                        w.experts.to_string(),
                        w.cores.len().to_string(),
                        if w.memory_bytes == 0 {
                            "-".into()
                        } else {
                            format!("{:.1} GiB", w.memory_bytes as f64 / (1u64 << 30) as f64)
                        },
                    ]);
                }
                print!("{}", table(&rows));
            }
        }
        CtlCommand::Load { png } => {
            let r = c
                .get_expert_load(GetExpertLoadRequest {})
                .await
                .map_err(rpc_err)?
                .into_inner();
            if let Some(path) = png {
                write_png(&r, path)?;
            }
            if args.json {
                println!("{}", load_json(&r));
            } else {
                print!("{}", heat_map(&r));
                if let Some(path) = png {
                    println!("heat map written to {}", path.display());
                }
            }
        }
        CtlCommand::Rebalance {
            dry_run,
            redundant,
            capacity,
            min_improvement,
        } => {
            let r = c
                .rebalance(RebalanceRequest {
                    redundant: *redundant,
                    capacity: *capacity,
                    dry_run: *dry_run,
                    min_improvement: *min_improvement,
                })
                .await
                .map_err(rpc_err)?
                .into_inner();
            print_outcome(&r, args.json)?;
        }
        CtlCommand::Drain { worker, dry_run } => {
            let r = c
                .drain_worker(DrainWorkerRequest {
                    worker: worker.clone(),
                    dry_run: *dry_run,
                })
                .await
                .map_err(rpc_err)?
                .into_inner();
            print_outcome(&r, args.json)?;
        }
        CtlCommand::SetPlacement { file, dry_run } => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let r = c
                .set_placement(SetPlacementRequest {
                    placement_json: text,
                    dry_run: *dry_run,
                })
                .await
                .map_err(rpc_err)?
                .into_inner();
            print_outcome(&r, args.json)?;
        }
        CtlCommand::Status => {
            let r = c
                .get_rebalance(GetRebalanceRequest {})
                .await
                .map_err(rpc_err)?
                .into_inner();
            if r.rebalance_json.is_empty() {
                if args.json {
                    println!("null");
                } else {
                    println!("no rebalance has run");
                }
                return Ok(());
            }
            let v: Value = serde_json::from_str(&r.rebalance_json)
                .context("the coordinator sent a corrupt rebalance document")?;
            if args.json {
                println!("{v}");
            } else {
                println!(
                    "rebalance {} ({}): {}, v{} → v{} {}",
                    v["id"].as_str().unwrap_or("?"),
                    v["reason"].as_str().unwrap_or("?"),
                    v["state"].as_str().unwrap_or("?"),
                    v["from"]["version"],
                    v["target"]["version"],
                    v["message"].as_str().unwrap_or("")
                );
            }
        }
    }
    Ok(())
}

fn print_outcome(r: &RebalanceResponse, as_json: bool) -> Result<()> {
    if as_json {
        let p: Value = serde_json::from_str(&r.placement_json).unwrap_or(Value::Null);
        println!(
            "{}",
            json!({"id": r.id, "state": r.state, "from_version": r.from_version,
                   "to_version": r.to_version, "current_balancedness": r.current_balancedness,
                   "predicted_balancedness": r.predicted_balancedness, "message": r.message,
                   "placement": p})
        );
        return Ok(());
    }
    println!(
        "{}{}: placement v{} → v{}{}",
        r.state,
        if r.id.is_empty() {
            String::new()
        } else {
            format!(" ({})", r.id)
        },
        r.from_version,
        r.to_version,
        if r.message.is_empty() {
            String::new()
        } else {
            format!(" — {}", r.message)
        }
    );
    let p: Value = serde_json::from_str(&r.placement_json).unwrap_or(Value::Null);
    let layers: Vec<String> = p["layers"]
        .as_array()
        .map(|a| a.iter().map(|l| l["layer"].to_string()).collect())
        .unwrap_or_default();
    let mut rows = vec![vec![
        "LAYER".to_string(),
        "CURRENT".into(),
        "PREDICTED".into(),
    ]];
    for (i, (c, p)) in r
        .current_balancedness
        .iter()
        .zip(&r.predicted_balancedness)
        .enumerate()
    {
        rows.push(vec![
            layers.get(i).cloned().unwrap_or_else(|| i.to_string()),
            format!("{c:.3}"),
            format!("{p:.3}"),
        ]);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    rows.push(vec![
        "mean".into(),
        format!("{:.3}", mean(&r.current_balancedness)),
        format!("{:.3}", mean(&r.predicted_balancedness)),
    ]);
    println!("balancedness (mean/max worker load, from the measured window):");
    print!("{}", table(&rows));
    Ok(())
}

/// Left-aligned columns separated by two spaces.
fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{s:<w$}", w = widths[i]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn placement_table(p: &Value) -> String {
    let workers: Vec<String> = p["workers"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|w| w.as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default();
    let layers = p["layers"].as_array().cloned().unwrap_or_default();
    let mut out = format!(
        "placement v{} over {} workers (* = replicated expert)\n",
        p["version"],
        workers.len()
    );
    let mut header = vec!["WORKER".to_string(), "EXPERTS".into()];
    header.extend(layers.iter().map(|l| format!("LAYER {}", l["layer"])));
    let mut rows = vec![header];
    for (wi, w) in workers.iter().enumerate() {
        let mut total = 0;
        let mut cells = Vec::new();
        for l in &layers {
            let mut held = Vec::new();
            for (e, reps) in l["experts"]
                .as_array()
                .map(|a| a.as_slice())
                .unwrap_or_default()
                .iter()
                .enumerate()
            {
                let reps: Vec<u64> = reps
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                if reps.contains(&(wi as u64)) {
                    held.push(if reps.len() > 1 {
                        format!("{e}*")
                    } else {
                        e.to_string()
                    });
                }
            }
            total += held.len();
            cells.push(if held.is_empty() {
                "-".into()
            } else {
                held.join(",")
            });
        }
        let mut row = vec![w.clone(), total.to_string()];
        row.extend(cells);
        rows.push(row);
    }
    out.push_str(&table(&rows));
    out
}

fn load_json(r: &GetExpertLoadResponse) -> Value {
    json!({
        "placement_version": r.placement_version,
        "window_steps": r.window_steps,
        "window_capacity": r.window_capacity,
        "workers": r.workers,
        "layers": r.layers.iter().map(|l| json!({
            "layer": l.layer,
            "balancedness": l.balancedness,
            "expert_tokens": l.expert_tokens,
            "worker_tokens": l.worker_tokens,
            "replicas": l.replicas.iter().map(|x| json!({"expert": x.expert, "worker": x.worker, "tokens": x.tokens, "tier": x.tier, "precision": x.precision})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

const SHADES: [char; 9] = [' ', '▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// The terminal heat map: one row per layer, one cell per expert, the bar
/// height its share of the layer's hottest expert.
fn heat_map(r: &GetExpertLoadResponse) -> String {
    let mut out = format!(
        "expert load, placement v{}, window {} of {} steps\n",
        r.placement_version, r.window_steps, r.window_capacity
    );
    let experts = r
        .layers
        .iter()
        .map(|l| l.expert_tokens.len())
        .max()
        .unwrap_or(0);
    out.push_str(&format!(
        "{:>6}  experts 0..{} (█ = the layer's hottest)  {:>6}  balancedness\n",
        "layer",
        experts.saturating_sub(1),
        "tokens"
    ));
    for l in &r.layers {
        let max = l.expert_tokens.iter().copied().max().unwrap_or(0);
        let cells: String = l
            .expert_tokens
            .iter()
            .map(|&t| {
                if max == 0 || t == 0 {
                    '·'
                } else {
                    SHADES[((t as f64 / max as f64) * 8.0).ceil().clamp(1.0, 8.0) as usize]
                }
            })
            .collect();
        out.push_str(&format!(
            "{:>6}  |{cells}|  {:>6}  {:.3}\n",
            l.layer,
            l.expert_tokens.iter().sum::<u64>(),
            l.balancedness
        ));
    }
    let mut rows = vec![{
        let mut h = vec!["WORKER".to_string()];
        h.extend(r.layers.iter().map(|l| format!("L{} TOKENS", l.layer)));
        h
    }];
    for (i, w) in r.workers.iter().enumerate() {
        let mut row = vec![w.clone()];
        row.extend(
            r.layers
                .iter()
                .map(|l| l.worker_tokens.get(i).map_or("-".into(), |t| t.to_string())),
        );
        rows.push(row);
    }
    out.push('\n');
    out.push_str(&table(&rows));
    out.push_str(&tier_map(r));
    out
}

/// One letter per replica: its tier, upper case for a 16/32-bit
/// precision, lower case for int8.
fn tier_cell(tier: &str, precision: &str) -> char {
    let c = match tier {
        "resident" => 'R',
        "cached" => 'C',
        "cold" => 'O',
        "mapped" => 'M',
        _ => '?',
    };
    if precision == "int8" {
        c.to_ascii_lowercase()
    } else {
        c
    }
}

/// Where each replica is kept and in what precision (as its worker said:
/// empty when no worker answered), one row per layer and worker, then the
/// counts per worker.
fn tier_map(r: &GetExpertLoadResponse) -> String {
    if r.layers
        .iter()
        .all(|l| l.replicas.iter().all(|x| x.tier.is_empty()))
    {
        return String::new();
    }
    let mut out = String::from(
        "\nexpert tiers: R resident, C cached, O cold (in the mapped checkpoint), M mapped \
         (computed from it); lower case int8, upper case bf16/f16/f32; blank: not on this worker\n",
    );
    // worker -> [resident, cached, cold, mapped, bf16, int8]
    let mut counts: BTreeMap<&str, [usize; 6]> = BTreeMap::new();
    for l in &r.layers {
        let n = l.expert_tokens.len();
        for w in &r.workers {
            let mut cells = vec![' '; n];
            let mut any = false;
            for x in l
                .replicas
                .iter()
                .filter(|x| &x.worker == w && !x.tier.is_empty())
            {
                if let Some(c) = cells.get_mut(x.expert as usize) {
                    *c = tier_cell(&x.tier, &x.precision);
                    any = true;
                }
                let k = counts.entry(w.as_str()).or_default();
                match x.tier.as_str() {
                    "resident" => k[0] += 1,
                    "cached" => k[1] += 1,
                    "cold" => k[2] += 1,
                    "mapped" => k[3] += 1,
                    _ => {}
                }
                if x.precision == "int8" {
                    k[5] += 1;
                } else {
                    k[4] += 1;
                }
            }
            if any {
                let cells: String = cells.into_iter().collect();
                out.push_str(&format!("{:>6}  |{cells}|  {w}\n", l.layer));
            }
        }
    }
    let mut rows = vec![
        [
            "WORKER", "RESIDENT", "CACHED", "COLD", "MAPPED", "BF16/F32", "INT8",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for (w, k) in counts {
        let mut row = vec![w.to_string()];
        row.extend(k.iter().map(|v| v.to_string()));
        rows.push(row);
    }
    out.push('\n');
    out.push_str(&table(&rows));
    out
}

/// A colour from white (cold) through yellow and orange to dark red (hot).
fn heat_colour(x: f64) -> [u8; 3] {
    const STOPS: [(f64, [f64; 3]); 4] = [
        (0.0, [255.0, 255.0, 255.0]),
        (0.33, [253.0, 216.0, 53.0]),
        (0.66, [244.0, 109.0, 67.0]),
        (1.0, [165.0, 0.0, 38.0]),
    ];
    let x = x.clamp(0.0, 1.0);
    for w in STOPS.windows(2) {
        let ((a, ca), (b, cb)) = (w[0], w[1]);
        if x <= b {
            let t = (x - a) / (b - a);
            let mut c = [0u8; 3];
            for i in 0..3 {
                c[i] = (ca[i] + (cb[i] - ca[i]) * t).round() as u8;
            }
            return c;
        }
    }
    [165, 0, 38]
}

/// Writes the heat map as an RGB PNG: one row of cells per layer, one cell per
/// expert, colour by load relative to the layer's hottest expert.
pub fn write_png(r: &GetExpertLoadResponse, path: &Path) -> Result<()> {
    const CELL: usize = 12;
    let experts = r
        .layers
        .iter()
        .map(|l| l.expert_tokens.len())
        .max()
        .unwrap_or(0);
    if experts == 0 || r.layers.is_empty() {
        bail!("no expert load to draw yet (no MoE layers or no traffic)");
    }
    let (w, h) = (experts * CELL, r.layers.len() * CELL);
    let mut px = vec![0u8; w * h * 3];
    for (li, l) in r.layers.iter().enumerate() {
        let max = l.expert_tokens.iter().copied().max().unwrap_or(0).max(1) as f64;
        for e in 0..experts {
            let t = l.expert_tokens.get(e).copied().unwrap_or(0) as f64;
            let c = heat_colour(t / max);
            for y in li * CELL..(li + 1) * CELL {
                for x in e * CELL..(e + 1) * CELL {
                    // A 1-pixel grey grid between cells.
                    let grid = y % CELL == CELL - 1 || x % CELL == CELL - 1;
                    let o = (y * w + x) * 3;
                    px[o..o + 3].copy_from_slice(if grid { &[200, 200, 200] } else { &c });
                }
            }
        }
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w as u32, h as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut wr = enc
        .write_header()
        .with_context(|| format!("cannot write {}", path.display()))?;
    wr.write_image_data(&px)
        .with_context(|| format!("cannot write {}", path.display()))?;
    wr.finish()
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use epserve_proto::pb::{LayerLoad, ReplicaLoad};

    fn sample() -> GetExpertLoadResponse {
        GetExpertLoadResponse {
            placement_version: 2,
            window_steps: 3,
            window_capacity: 10,
            workers: vec!["a".into(), "b".into()],
            layers: vec![LayerLoad {
                layer: 0,
                expert_tokens: vec![8, 0, 2, 1],
                replicas: vec![],
                worker_tokens: vec![9, 2],
                balancedness: 5.5 / 9.0,
            }],
        }
    }

    #[test]
    fn heat_map_rows_and_png() {
        let s = heat_map(&sample());
        assert!(s.contains("|█·▂▁|"), "{s}");
        assert!(s.contains("0.611"), "{s}");
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("load.png");
        write_png(&sample(), &f).expect("png");
        let bytes = std::fs::read(&f).expect("read");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let dec = png::Decoder::new(std::io::Cursor::new(bytes));
        let reader = dec.read_info().expect("decode");
        assert_eq!((reader.info().width, reader.info().height), (48, 12));
        assert_eq!(heat_colour(0.0), [255, 255, 255]);
        assert_eq!(heat_colour(1.0), [165, 0, 38]);
    }

    #[test]
    fn tier_map_shows_each_replica() {
        let mut r = sample();
        assert!(!heat_map(&r).contains("expert tiers"), "no tiers, no map");
        let rep = |expert: u32, worker: &str, tier: &str, precision: &str| ReplicaLoad {
            expert,
            worker: worker.into(),
            tokens: 1,
            tier: tier.into(),
            precision: precision.into(),
        };
        r.layers[0].replicas = vec![
            rep(0, "a", "resident", "bf16"),
            rep(1, "a", "cached", "int8"),
            rep(2, "b", "cold", "bf16"),
            rep(3, "b", "cold", "int8"),
            rep(0, "b", "", ""),
        ];
        let s = heat_map(&r);
        assert!(s.contains("|Rc  |  a"), "{s}");
        assert!(s.contains("|  Oo|  b"), "{s}");
        assert!(
            s.contains("a       1         1       0     0       1         1"),
            "{s}"
        );
        assert!(
            s.contains("b       0         0       2     0       1         1"),
            "{s}"
        );
        let j = load_json(&r);
        assert_eq!(j["layers"][0]["replicas"][1]["tier"], "cached");
        assert_eq!(j["layers"][0]["replicas"][1]["precision"], "int8");
    }

    #[test]
    fn placement_table_marks_replicas() {
        let p = json!({"version": 3, "workers": ["a", "b"], "layers": [
            {"layer": 1, "experts": [[0, 1], [1]]}]});
        let t = placement_table(&p);
        assert!(t.contains("a       1        0*"), "{t}");
        assert!(t.contains("b       2        0*,1"), "{t}");
    }
}
