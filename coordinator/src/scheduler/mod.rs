//! The scheduler: one thread owns all request state and the KV pool; the HTTP
//! layer talks to it through channels (TGI's queue pattern). Every step it
//! builds one batch under a token budget — running sequences first (decodes and
//! unfinished prefill chunks), then waiting ones in arrival order (chunked
//! prefill) — runs one forward pass, samples, and streams events back.
//! When the KV pool runs out, the most recently admitted sequence is preempted
//! (its blocks freed, recomputed later from its tokens), so older requests
//! always make progress.
//!
//! With automatic prefix caching (on by default, `--no-enable-prefix-caching`
//! turns it off) a sequence being admitted first attaches the longest chain of
//! cached full KV blocks matching its tokens ([`KvPool::match_prefix`]) and
//! starts computing after them; finished and preempted sequences leave their
//! full blocks cached in the pool's LRU for the next request with that prefix.
//!
//! A request with `n` > 1 is admitted as one sequence (choice 0). When its
//! prompt is computed, the other `n - 1` choices sample their first token from
//! the same logits and fork its block table ([`KvPool::fork`]: full blocks
//! shared by reference count, the partial last block copied), with or without
//! prefix caching, so the prompt is computed once. A choice that finds no free
//! batch slot or block for the copy (or runs with remote attention, whose
//! shards keep KV per sequence) waits like a preempted sequence, holding no
//! blocks, and recomputes its tokens (from the prefix cache where it is on).
//! A preempted choice does the same.

mod micro;
mod seq;

pub use micro::{MicroBatches, MicroPolicy};

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use epserve_core::engine::{Engine, FinishReason};
use epserve_core::model::kv_cache::KvPool;
use epserve_core::model::{LogitsMode, SeqInput};
use epserve_core::sampling::SamplingParams;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::metrics as m;
use seq::Seq;

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences in one batch.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes) in one forward pass.
    pub max_num_batched_tokens: usize,
    /// Prompt plus completion may not exceed this.
    pub max_model_len: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Requests allowed to wait; beyond it new ones are refused (503).
    pub max_waiting: usize,
    /// Element type of the KV cache.
    pub kv_dtype: epserve_core::model::kv_cache::KvDtype,
    /// Into how many micro-batches a step is split (`--micro-batches`).
    pub micro_batches: MicroBatches,
    /// Automatic prefix caching (`--no-enable-prefix-caching` turns it off;
    /// works with attention-workers too).
    pub enable_prefix_caching: bool,
    /// Per-expert token counters (`--expert-load-metrics`; layers x experts series).
    pub expert_load_metrics: bool,
    /// A step's sampling sequences choose their tokens in parallel on the
    /// compute threads when there are at least two and their logits number
    /// at least this many ([`PARALLEL_CHOOSE_MIN_LOGITS`]; below it handing
    /// out the work costs more than it saves).
    pub parallel_choose_min_logits: usize,
}

/// The default [`SchedulerConfig::parallel_choose_min_logits`]: `bench
/// sampling` puts handing a batch to the pool at ~10 µs, a pass over 64k
/// logits at about as much.
pub const PARALLEL_CHOOSE_MIN_LOGITS: usize = 1 << 16;

/// Counters the scheduler thread keeps, readable from any thread.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// Tokens of admitted sequences looked up in the prefix cache.
    pub prefix_cache_queries: AtomicU64,
    /// Of those, tokens found cached (their prefill skipped).
    pub prefix_cache_hits: AtomicU64,
    /// Sequences preempted for lack of KV blocks.
    pub preemptions: AtomicU64,
    /// Tokens chosen in a step's parallel batch (`choose_all`) rather than
    /// in place.
    pub parallel_choices: AtomicU64,
    /// Tokens run through the forward pass (prefill chunks and decodes).
    pub computed_tokens: AtomicU64,
    /// KV blocks no sequence holds (truly free plus cached-free), after the
    /// last step.
    pub free_blocks: AtomicUsize,
}

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `Some(n)`: return the chosen token's logprob and the n most likely.
    pub logprobs: Option<usize>,
    /// Completions of this prompt (OpenAI's `n`, at least 1): the prompt is
    /// computed once and its KV blocks shared by every choice.
    pub n: usize,
    /// vLLM's `cache_salt`: only requests with the same salt share cached
    /// KV blocks (mixed into the first block's hash).
    pub cache_salt: Option<String>,
    /// Structured output: the grammar the generated text must match
    /// (compiled with [`Engine::compile_constraint`]).
    pub constraint: Option<epserve_core::structured::CompiledConstraint>,
}

/// Log-probabilities of one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// The most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
}

/// What a request's stream receives.
#[derive(Debug, Clone)]
pub enum Event {
    /// One generated token and the text it released (possibly empty).
    Token {
        /// The choice (0..n) it belongs to.
        index: usize,
        token_id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// One choice of the request ended normally (the request is done when
    /// all `n` have).
    Finished {
        index: usize,
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Set when some of its tokens were computed with a lost expert
        /// rerouted (`--on-expert-loss reroute`): why.
        degraded: Option<String>,
    },
    /// The request failed (a bug: answered with 500).
    Error(String),
    /// The request failed because part of the cluster is unavailable (an
    /// expert with no live replica, a failed worker): retryable, 503.
    Unavailable(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq)]
pub enum SubmitError {
    /// Too many requests waiting; retry later.
    Overloaded { waiting: usize },
    /// The request can never fit the KV cache.
    TooLarge(String),
    /// The scheduler has stopped.
    Closed,
}

enum Msg {
    Submit(Box<Seq>),
}

/// Cheap, cloneable access to the scheduler thread.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Msg>,
    waiting: Arc<AtomicUsize>,
    next_id: Arc<AtomicU64>,
    config: SchedulerConfig,
    block_size: usize,
    num_blocks: usize,
    stats: Arc<SchedulerStats>,
}

impl SchedulerHandle {
    /// The limits in force.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The scheduler's counters.
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// Queues a request; events arrive on the returned receiver. Dropping the
    /// receiver cancels the request and frees its KV blocks.
    pub fn submit(&self, req: Request) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let total = req.prompt_token_ids.len() + req.max_tokens;
        let blocks = total.div_ceil(self.block_size);
        if blocks > self.num_blocks {
            return Err(SubmitError::TooLarge(format!(
                "prompt ({} tokens) plus max_tokens ({}) needs {blocks} KV blocks; the cache has {}",
                req.prompt_token_ids.len(),
                req.max_tokens,
                self.num_blocks
            )));
        }
        let waiting = self.waiting.load(Ordering::Relaxed);
        if waiting >= self.config.max_waiting {
            // Counted once, by the 503 the server answers.
            return Err(SubmitError::Overloaded { waiting });
        }
        let (tx, rx) = unbounded_channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let seq = Seq::new(id, req, tx);
        if self.tx.send(Msg::Submit(Box::new(seq))).is_err() {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::Closed);
        }
        Ok(rx)
    }
}

/// Starts the scheduler thread for `engine`.
pub fn start(engine: Arc<Engine>, config: SchedulerConfig) -> std::io::Result<SchedulerHandle> {
    let (tx, rx) = mpsc::channel();
    let waiting = Arc::new(AtomicUsize::new(0));
    let mut pool = engine
        .model
        .new_pool(config.block_size, config.num_blocks, config.kv_dtype);
    if config.enable_prefix_caching {
        // With attention-workers too: they store the keys/values of this
        // pool's block ids, so a block shared here is shared on every shard.
        let c = &engine.model.config;
        pool.enable_prefix_caching(&format!(
            "{}|{:?}|{}|{}|{}",
            engine.dir.display(),
            c.arch,
            c.num_hidden_layers,
            c.hidden_size,
            c.vocab_size
        ));
        tracing::info!(
            block_size = pool.block_size(),
            remote_attention = engine.model.remote_attention().is_some(),
            "prefix caching enabled"
        );
    }
    let stats = Arc::new(SchedulerStats::default());
    stats
        .free_blocks
        .store(pool.free_blocks(), Ordering::Relaxed);
    let handle = SchedulerHandle {
        tx,
        waiting: waiting.clone(),
        next_id: Arc::new(AtomicU64::new(1)),
        block_size: pool.block_size(),
        num_blocks: pool.num_blocks(),
        config: config.clone(),
        stats: stats.clone(),
    };
    let cfg = &engine.model.config;
    let policy = MicroPolicy::new(
        config.micro_batches,
        cfg.moe_layers().len(),
        cfg.num_experts,
        cfg.num_experts_per_tok,
    );
    let mut s = Scheduler {
        engine,
        policy,
        config,
        pool,
        waiting: VecDeque::new(),
        running: Vec::new(),
        waiting_count: waiting,
        rx,
        stats,
    };
    std::thread::Builder::new()
        .name("epserve-scheduler".into())
        .spawn(move || s.run())?;
    Ok(handle)
}

struct Scheduler {
    engine: Arc<Engine>,
    policy: MicroPolicy,
    config: SchedulerConfig,
    pool: KvPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    waiting_count: Arc<AtomicUsize>,
    rx: mpsc::Receiver<Msg>,
    stats: Arc<SchedulerStats>,
}

impl Scheduler {
    fn run(&mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                // Idle: free what remote attention shards still hold for us.
                self.engine.model.flush_releases();
                match self.rx.recv() {
                    Ok(msg) => self.handle(msg),
                    Err(_) => return,
                }
            }
            while let Ok(msg) = self.rx.try_recv() {
                self.handle(msg);
            }
            self.drop_cancelled();
            self.step();
            self.publish_gauges();
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Submit(seq) => self.waiting.push_back(*seq),
        }
    }

    fn publish_gauges(&self) {
        m::set_queue(self.running.len(), self.waiting.len());
        let free = self.pool.free_blocks();
        self.stats.free_blocks.store(free, Ordering::Relaxed);
        let used = self.pool.num_blocks() - free;
        m::set_kv_usage(used as f64 / self.pool.num_blocks().max(1) as f64);
    }

    /// Requests whose client went away are dropped and their blocks freed.
    fn drop_cancelled(&mut self) {
        let pool = &mut self.pool;
        let model = &self.engine.model;
        let mut removed_waiting = 0;
        self.waiting.retain_mut(|s| {
            if s.tx.is_closed() {
                model.release(pool, &mut s.cache);
                removed_waiting += 1;
                if s.index == 0 {
                    m::request_finished("cancelled");
                }
                false
            } else {
                true
            }
        });
        self.waiting_count
            .fetch_sub(removed_waiting, Ordering::Relaxed);
        self.running.retain_mut(|s| {
            if s.tx.is_closed() {
                model.release(pool, &mut s.cache);
                // A request with n > 1 is counted once, by choice 0.
                if s.index == 0 {
                    m::request_finished("cancelled");
                }
                false
            } else {
                true
            }
        });
    }

    /// Frees the most recently admitted running sequence and puts it back at
    /// the head of the waiting queue (recompute preemption).
    fn preempt_last(&mut self) {
        if let Some(mut s) = self.running.pop() {
            self.engine.model.release(&mut self.pool, &mut s.cache);
            s.num_computed = 0;
            s.step_take = 0;
            s.preemptions += 1;
            self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
            m::preempted();
            tracing::debug!(id = s.id, "preempted");
            self.waiting.push_front(s);
            self.waiting_count.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn schedule(&mut self) -> usize {
        let mut budget = self.config.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() {
            self.running[i].step_take = 0;
            let need = self.running[i].tokens.len() - self.running[i].num_computed;
            let take = need.min(budget);
            if take == 0 {
                i += 1;
                continue;
            }
            let target = self.running[i].num_computed + take;
            loop {
                if self
                    .pool
                    .reserve(&mut self.running[i].cache, target)
                    .is_ok()
                {
                    self.running[i].step_take = take;
                    budget -= take;
                    break;
                }
                let last = self.running.len() - 1;
                self.preempt_last();
                if last == i {
                    break;
                }
            }
            i += 1;
        }
        while self.running.len() < self.config.max_num_seqs && budget > 0 {
            let Some(front) = self.waiting.front_mut() else {
                break;
            };
            // Waiting sequences hold no blocks: attach the cached prefix
            // (if any) and compute from there.
            let hit = if front.num_computed == 0 && front.cache.is_empty() {
                self.pool.match_prefix(&mut front.cache, &front.tokens)
            } else {
                0
            };
            front.num_computed += hit;
            let need = front.tokens.len() - front.num_computed;
            let take = need.min(budget);
            if self
                .pool
                .reserve(&mut front.cache, front.num_computed + take)
                .is_err()
            {
                // Give the prefix back while it waits (it is looked up again).
                if hit > 0 {
                    self.pool.release(&mut front.cache);
                    front.num_computed = 0;
                }
                // FCFS: nobody jumps the queue; wait for blocks to free up.
                break;
            }
            if self.pool.prefix_caching() {
                let queried = front.tokens.len() as u64;
                self.stats
                    .prefix_cache_queries
                    .fetch_add(queried, Ordering::Relaxed);
                self.stats
                    .prefix_cache_hits
                    .fetch_add(hit as u64, Ordering::Relaxed);
                m::prefix_cache(queried, hit as u64);
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            self.waiting_count.fetch_sub(1, Ordering::Relaxed);
            s.step_take = take;
            budget -= take;
            self.running.push(s);
        }
        self.config.max_num_batched_tokens - budget
    }

    /// Each running sequence's row of this step's logits: `Some` for those
    /// that finish their prompt or decode this step (whether or not a row
    /// of theirs was lost: the forward pass returns their row either way),
    /// `None` for idle sequences and prefill chunks short of the prompt's
    /// end. The one place that rule lives; call before `num_computed`
    /// moves on.
    fn logit_rows(&self) -> Vec<Option<usize>> {
        let mut row = 0;
        (self.running.iter())
            .map(|s| {
                let done = s.step_take > 0 && s.num_computed + s.step_take >= s.tokens.len();
                done.then(|| {
                    row += 1;
                    row - 1
                })
            })
            .collect()
    }

    /// Every sequence's next token from this step's logits, chosen in
    /// parallel on the compute threads (idle between steps): the masks,
    /// sampling and logprobs of a batch cost one sequence's time per
    /// thread, not the sum, before the next step can start. Entries are
    /// `None` for sequences that sample nothing this step (a prefill chunk,
    /// a lost row), whose logits row is missing, or that are constrained by
    /// a grammar; one sequence is chosen in place.
    fn choose_all(
        &mut self,
        logits: &[f32],
        vocab: usize,
        rows: &[Option<usize>],
        lost: &HashMap<usize, String>,
    ) -> Vec<Option<seq::Choice>> {
        use rayon::prelude::*;
        let rows: Vec<Option<&[f32]>> = (self.running.iter().zip(rows).enumerate())
            .map(|(idx, (s, row))| {
                // A grammar's mask may still be computing on the same
                // threads (`Guide::prefetch`): waiting for it inside one
                // could block them all, so those sequences choose in place.
                if lost.contains_key(&idx) || s.guide.is_some() {
                    return None;
                }
                let row = (*row)?;
                logits.get(row * vocab..(row + 1) * vocab)
            })
            .collect();
        let n = rows.iter().flatten().count();
        if n < 2 || n * vocab < self.config.parallel_choose_min_logits {
            return vec![None; rows.len()];
        }
        (self.stats.parallel_choices).fetch_add(n as u64, Ordering::Relaxed);
        (self.running.par_iter_mut().zip(rows))
            .map(|(s, l)| l.map(|l| s.choose(l)))
            .collect()
    }

    #[tracing::instrument(
        level = "debug",
        name = "step",
        skip_all,
        fields(seqs = tracing::field::Empty, tokens = tracing::field::Empty)
    )]
    fn step(&mut self) {
        let n_tokens = self.schedule();
        if n_tokens == 0 {
            if !self.waiting.is_empty() && self.running.is_empty() {
                // Cannot happen with the submit-time size check; fail loudly rather than spin.
                if let Some(s) = self.waiting.pop_front() {
                    self.waiting_count.fetch_sub(1, Ordering::Relaxed);
                    let _ =
                        s.tx.send(Event::Error("request does not fit the KV cache".into()));
                    m::request_finished("error");
                }
            }
            return;
        }
        let engine = self.engine.clone();
        let mut inputs = Vec::new();
        for s in self.running.iter_mut().filter(|s| s.step_take > 0) {
            let Seq {
                tokens,
                cache,
                num_computed,
                step_take,
                ..
            } = s;
            inputs.push(SeqInput {
                tokens: &tokens[*num_computed..*num_computed + *step_take],
                cache,
                // A prefill chunk short of the prompt's end needs no logits.
                logits: *num_computed + *step_take == tokens.len(),
            });
        }
        let n_seqs = inputs.len();
        let span = tracing::Span::current();
        span.record("seqs", n_seqs);
        span.record("tokens", n_tokens);
        let micro_batches = self.policy.choose(n_seqs, n_tokens);
        let trace_router = self.config.expert_load_metrics;
        let started = Instant::now();
        // A panic in the model (a bug) fails this step's requests, not the server.
        let pool = &mut self.pool;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine.model.forward_micro(
                &mut inputs,
                pool,
                LogitsMode::Last,
                trace_router,
                micro_batches,
            )
        }))
        .unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            // Not a dispatch or attention failure: a bug (answered with 500).
            Err(epserve_core::Error::Internal(format!(
                "panic in the forward pass: {msg}"
            )))
        });
        drop(inputs);
        let elapsed = started.elapsed();
        m::step(n_seqs, n_tokens, elapsed.as_secs_f64());
        self.stats
            .computed_tokens
            .fetch_add(n_tokens as u64, Ordering::Relaxed);
        let out = match result {
            Ok(o) => {
                m::micro_step(micro_batches, o.waited.as_secs_f64());
                self.policy.observe(
                    n_tokens,
                    micro_batches,
                    elapsed,
                    o.waited,
                    &o.dispatch_timings,
                );
                o
            }
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed");
                let msg = e.to_string();
                // A failed worker or shard is the cluster's state, not a bug:
                // the client may retry.
                let retryable = matches!(
                    e,
                    epserve_core::Error::Dispatch(_) | epserve_core::Error::Attention(_)
                );
                if matches!(e, epserve_core::Error::Attention(_)) && self.pool.prefix_caching() {
                    // A shard may have restarted and lost the keys/values of
                    // cached blocks: nothing cached is offered again.
                    self.pool.clear_prefix_cache();
                    tracing::warn!("attention failed: prefix cache cleared");
                }
                for mut s in std::mem::take(&mut self.running) {
                    self.engine.model.release(&mut self.pool, &mut s.cache);
                    if retryable {
                        let _ = s.tx.send(Event::Unavailable(msg.clone()));
                        m::request_finished("unavailable");
                    } else {
                        let _ = s.tx.send(Event::Error(msg.clone()));
                        m::request_finished("error");
                    }
                }
                return;
            }
        };
        // Sequences with rows whose experts were unreachable: lost ones fail
        // (retryable), degraded ones are flagged; the rest are exact.
        let mut lost: HashMap<usize, String> = HashMap::new();
        if !out.faults.is_empty() {
            let mut start = 0;
            for (idx, s) in self.running.iter_mut().enumerate() {
                if s.step_take == 0 {
                    continue;
                }
                let rows = start..start + s.step_take;
                start += s.step_take;
                let mut faulty = false;
                for f in out.faults.iter().filter(|f| rows.contains(&f.row)) {
                    faulty = true;
                    if f.degraded {
                        if s.degraded.is_none() {
                            s.degraded = Some(f.message.clone());
                        }
                    } else {
                        lost.entry(idx).or_insert_with(|| f.message.clone());
                    }
                }
                if faulty {
                    // Keys/values computed without part of the model are
                    // never offered to another request.
                    self.pool.uncache(&mut s.cache);
                }
            }
        }
        for t in &out.router {
            m::expert_load(
                t.layer,
                &t.routing.topk_ids,
                self.engine.model.config.num_experts,
            );
        }
        let vocab = self.engine.model.config.vocab_size;
        let rows = self.logit_rows();
        let mut choices = self.choose_all(&out.logits, vocab, &rows, &lost);
        let mut finished = Vec::new();
        let mut forked = Vec::new();
        let mut unforked = Vec::new();
        // Remote attention shards keep KV per sequence: nothing to share there.
        let can_fork = self.engine.model.remote_attention().is_none();
        let max_running = self.config.max_num_seqs;
        let n_running = self.running.len();
        for (idx, s) in self.running.iter_mut().enumerate() {
            if s.step_take == 0 {
                continue;
            }
            s.num_computed += s.step_take;
            s.step_take = 0;
            if let Some(why) = lost.get(&idx) {
                let _ = s.tx.send(Event::Unavailable(format!(
                    "part of the model is unavailable: {why}; retry shortly"
                )));
                m::request_finished("unavailable");
                finished.push(idx);
                continue;
            }
            let Some(row) = rows[idx] else {
                continue; // a prefill chunk; more to come (it got no logits)
            };
            let Some(logits) = out.logits.get(row * vocab..(row + 1) * vocab) else {
                tracing::error!(row, "the forward pass returned too few logit rows");
                let _ =
                    s.tx.send(Event::Error("internal error: missing logits".into()));
                finished.push(idx);
                m::request_finished("error");
                continue;
            };
            // n > 1: the prompt is computed; every other choice samples its
            // first token from these logits and shares the prompt's blocks.
            for index in 1..=std::mem::take(&mut s.pending_forks) {
                let mut c = s.child(index);
                c.num_computed = c.tokens.len();
                let cache = if can_fork && n_running + forked.len() < max_running {
                    self.pool.fork(&s.cache)
                } else {
                    None
                };
                let has_cache = cache.is_some();
                match cache {
                    Some(cache) => c.cache = cache,
                    // No slot or no block for it now: it waits, holding no
                    // blocks, and recomputes the prompt (from the prefix
                    // cache where it is on) like a preempted sequence.
                    None => c.num_computed = 0,
                }
                if c.on_logits(&self.engine, logits, self.config.max_model_len) {
                    self.engine.model.release(&mut self.pool, &mut c.cache);
                } else if has_cache {
                    forked.push(c);
                } else {
                    unforked.push(c);
                }
            }
            let choice = match choices[idx].take() {
                Some(c) => c,
                None => s.choose(logits),
            };
            if s.on_token(&self.engine, choice, self.config.max_model_len) {
                finished.push(idx);
            }
        }
        for idx in finished.into_iter().rev() {
            let mut s = self.running.remove(idx);
            self.engine.model.release(&mut self.pool, &mut s.cache);
        }
        self.running.extend(forked);
        self.waiting_count
            .fetch_add(unforked.len(), Ordering::Relaxed);
        for c in unforked.into_iter().rev() {
            self.waiting.push_front(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use epserve_core::config::ModelConfig;
    use epserve_core::loader::generation::GenerationConfig;
    use epserve_core::loader::tokenizer::Tokenizer;
    use epserve_core::loader::weights::WeightStore;
    use epserve_core::model::Model;
    use epserve_core::moe::{Dispatched, Dispatcher, PendingDispatch, Routing};

    /// Expert dispatch that panics, standing in for a bug in the forward pass.
    struct Panics;

    impl Dispatcher for Panics {
        fn submit(
            &self,
            _layer: usize,
            _x: Arc<[f32]>,
            _hidden: usize,
            _routing: Arc<Routing>,
        ) -> epserve_core::Result<PendingDispatch> {
            panic!("test bug in the forward pass")
        }
    }

    /// The qwen3_moe_a fixture's engine with `dispatcher` for its experts,
    /// and a small scheduler over it.
    fn fixture_scheduler(dispatcher: Arc<dyn Dispatcher>) -> (Arc<Engine>, SchedulerHandle) {
        fixture_scheduler_choosing(dispatcher, PARALLEL_CHOOSE_MIN_LOGITS)
    }

    fn fixture_scheduler_choosing(
        dispatcher: Arc<dyn Dispatcher>,
        parallel_choose_min_logits: usize,
    ) -> (Arc<Engine>, SchedulerHandle) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_moe_a/f32");
        let load = || -> epserve_core::Result<Engine> {
            let cfg = ModelConfig::from_dir(&dir)?;
            let ws = WeightStore::open(&dir)?;
            let model = Model::from_store(cfg, &ws, dispatcher)?;
            Ok(Engine::from_parts(
                model,
                Tokenizer::from_dir(&dir)?,
                GenerationConfig::from_dir(&dir)?,
                &dir,
            ))
        };
        let engine = Arc::new(load().expect("fixture engine"));
        let handle = start(
            engine.clone(),
            SchedulerConfig {
                max_num_seqs: 4,
                max_num_batched_tokens: 64,
                max_model_len: 64,
                block_size: 16,
                num_blocks: 16,
                max_waiting: 4,
                kv_dtype: Default::default(),
                micro_batches: MicroBatches::Fixed(1),
                enable_prefix_caching: true,
                expert_load_metrics: false,
                parallel_choose_min_logits,
            },
        )
        .expect("scheduler");
        (engine, handle)
    }

    /// A 3-token prompt asking for 4 tokens, eos ignored.
    fn three_tokens(engine: &Engine) -> Request {
        Request {
            prompt_token_ids: vec![1, 2, 3],
            max_tokens: 4,
            sampling: engine.default_sampling(),
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: true,
            logprobs: None,
            n: 1,
            cache_salt: None,
            constraint: None,
        }
    }

    #[test]
    fn a_panic_in_the_forward_pass_is_an_internal_error_and_the_server_lives_on() {
        let (engine, handle) = fixture_scheduler(Arc::new(Panics));
        let request = three_tokens(&engine);
        // Twice: the scheduler thread survives the first panic.
        for _ in 0..2 {
            let mut rx = handle.submit(request.clone()).expect("submit");
            let msg = match rx.blocking_recv() {
                Some(Event::Error(msg)) => msg,
                other => panic!("expected an error event, got {:?}", other.is_some()),
            };
            assert_eq!(
                msg,
                "internal error: panic in the forward pass: test bug in the forward pass"
            );
            let e = crate::server::error::ApiError::internal(msg);
            let body = e.body();
            assert_eq!(e.status, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(body["error"]["type"], "internal_error");
            assert!(body["error"]["message"].is_string());
        }
    }

    /// Expert dispatch whose experts all return zeros and that reports
    /// every row as lost while `lose` is set (an expert with no live
    /// replica), standing in for the cluster's dispatcher.
    struct Lossy {
        lose: std::sync::atomic::AtomicBool,
    }

    impl Dispatcher for Lossy {
        fn submit(
            &self,
            layer: usize,
            _x: Arc<[f32]>,
            hidden: usize,
            routing: Arc<Routing>,
        ) -> epserve_core::Result<PendingDispatch> {
            let lost = if self.lose.load(Ordering::Relaxed) {
                0..routing.num_tokens
            } else {
                0..0
            };
            Ok(zeros_losing(layer, hidden, routing.num_tokens, lost))
        }
    }

    /// The dispatch result of the test dispatchers: zeros for every row,
    /// `lost` rows reported as an expert with no live replica.
    fn zeros_losing(
        layer: usize,
        hidden: usize,
        rows: usize,
        lost: std::ops::Range<usize>,
    ) -> PendingDispatch {
        let faults = (lost.map(|row| epserve_core::moe::RowFault {
            row,
            message: format!("layer {layer}: expert 0 has no live replica"),
            degraded: false,
        }))
        .collect();
        PendingDispatch::ready(Ok(Dispatched {
            y: vec![0.0; rows * hidden],
            faults,
            timing: None,
        }))
    }

    #[test]
    fn a_lost_expert_fails_its_request_with_a_retryable_error_and_later_ones_succeed() {
        let lossy = Arc::new(Lossy {
            lose: std::sync::atomic::AtomicBool::new(true),
        });
        let (engine, handle) = fixture_scheduler(lossy.clone());
        let request = three_tokens(&engine);
        let mut rx = handle.submit(request.clone()).expect("submit");
        let msg = match rx.blocking_recv() {
            Some(Event::Unavailable(msg)) => msg,
            other => panic!("expected an unavailable event, got {:?}", other.is_some()),
        };
        assert!(msg.contains("expert 0 has no live replica"), "{msg}");
        let e = crate::server::error::ApiError::cluster_unavailable(msg);
        assert_eq!(e.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.retry_after, Some(1));
        assert!(rx.blocking_recv().is_none(), "nothing after the error");

        // The experts are back: the next request completes.
        lossy.lose.store(false, Ordering::Relaxed);
        let mut rx = handle.submit(request).expect("submit");
        let mut tokens = 0;
        loop {
            match rx.blocking_recv() {
                Some(Event::Token { .. }) => tokens += 1,
                Some(Event::Finished { degraded, .. }) => {
                    assert!(degraded.is_none());
                    break;
                }
                other => panic!("unexpected event: {:?}", other.is_some()),
            }
        }
        assert_eq!(tokens, 4);
    }

    /// Expert dispatch whose experts return zeros and that reports the
    /// first row of every batch of three or more rows as lost; its first
    /// call waits for `gate` (so a test can queue requests behind it).
    struct LosesFirstOfThree {
        gate: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    }

    impl Dispatcher for LosesFirstOfThree {
        fn submit(
            &self,
            layer: usize,
            _x: Arc<[f32]>,
            hidden: usize,
            routing: Arc<Routing>,
        ) -> epserve_core::Result<PendingDispatch> {
            let gate = self.gate.lock().map(|mut g| g.take()).unwrap_or(None);
            if let Some(gate) = gate {
                let _ = gate.recv_timeout(std::time::Duration::from_secs(30));
            }
            let lost = if routing.num_tokens >= 3 { 0..1 } else { 0..0 };
            Ok(zeros_losing(layer, hidden, routing.num_tokens, lost))
        }
    }

    /// A step where one sequence's row is lost and the others sample on the
    /// pool (`choose_all`): the lost one fails retryably, every other gets
    /// the tokens it gets alone, on the serial and the parallel path.
    #[test]
    fn lost_rows_beside_healthy_ones_fail_alone_on_both_choose_paths() {
        // One-token prompts: two sequences never make three rows, so only
        // a step with all three loses a row, the first sequence's.
        let request = |i: u32| {
            let mut r = greedy(vec![10 + 7 * i], 6);
            r.sampling.temperature = 0.8;
            r.sampling.seed = Some(i as u64);
            r
        };
        let dispatcher = |gate| {
            Arc::new(LosesFirstOfThree {
                gate: std::sync::Mutex::new(gate),
            })
        };
        let (_, solo) = fixture_scheduler(dispatcher(None));
        let want: Vec<Vec<u32>> = (0..3).map(|i| run_one(&solo, request(i))).collect();
        for min_logits in [usize::MAX, 0] {
            let (open, gate) = std::sync::mpsc::channel();
            let (_, h) = fixture_scheduler_choosing(dispatcher(Some(gate)), min_logits);
            // The first step waits at the gate until all three are queued.
            let rxs: Vec<_> = (0..3)
                .map(|i| h.submit(request(i)).expect("submit"))
                .collect();
            let _ = open.send(());
            let mut outcome = Vec::new();
            for (i, mut rx) in rxs.into_iter().enumerate() {
                let mut got = Vec::new();
                loop {
                    match rx.blocking_recv() {
                        Some(Event::Token { token_id, .. }) => got.push(token_id),
                        Some(Event::Finished { .. }) => {
                            assert_eq!(got, want[i], "request {i}, threshold {min_logits}");
                            outcome.push("done");
                            break;
                        }
                        Some(Event::Unavailable(msg)) => {
                            assert!(msg.contains("no live replica"), "{msg}");
                            outcome.push("lost");
                            break;
                        }
                        Some(Event::Error(e)) => panic!("request {i}: {e}"),
                        None => panic!("request {i}: stream ended without finishing"),
                    }
                }
            }
            assert_eq!(outcome, ["lost", "done", "done"], "threshold {min_logits}");
            let pooled = h.stats().parallel_choices.load(Ordering::Relaxed);
            if min_logits == usize::MAX {
                assert_eq!(pooled, 0);
            } else {
                // The lossy step's two healthy rows, at least.
                assert!(pooled >= 2, "{pooled} chosen on the pool");
            }
        }
    }

    #[test]
    fn keys_and_values_computed_with_a_lost_expert_are_not_cached() {
        let lossy = Arc::new(Lossy {
            lose: std::sync::atomic::AtomicBool::new(true),
        });
        let (engine, handle) = fixture_scheduler(lossy.clone());
        // 40 tokens: two full blocks of 16 are written by the failing step.
        let mut request = three_tokens(&engine);
        request.prompt_token_ids = (1..41).collect();
        request.max_tokens = 2;
        let mut rx = handle.submit(request.clone()).expect("submit");
        assert!(matches!(rx.blocking_recv(), Some(Event::Unavailable(_))));
        lossy.lose.store(false, Ordering::Relaxed);
        let hits = || handle.stats().prefix_cache_hits.load(Ordering::Relaxed);
        collect(handle.submit(request.clone()).expect("submit"));
        assert_eq!(hits(), 0, "the failed request's blocks were reused");
        // The clean run's blocks are.
        collect(handle.submit(request).expect("submit"));
        assert_eq!(hits(), 32);
        assert_all_blocks_free(&handle, 16);
    }

    /// The qwen3_moe_a fixture with its own experts, under a scheduler of
    /// `num_blocks` blocks of 4 positions, prefix caching on or off.
    fn local_scheduler(cache: bool, num_blocks: usize, max_num_seqs: usize) -> SchedulerHandle {
        local_scheduler_choosing(cache, num_blocks, max_num_seqs, PARALLEL_CHOOSE_MIN_LOGITS)
    }

    fn local_scheduler_choosing(
        cache: bool,
        num_blocks: usize,
        max_num_seqs: usize,
        parallel_choose_min_logits: usize,
    ) -> SchedulerHandle {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_moe_a/f32");
        let engine = Arc::new(Engine::load(&dir).expect("fixture engine"));
        start(
            engine,
            SchedulerConfig {
                max_num_seqs,
                max_num_batched_tokens: 32,
                max_model_len: 128,
                block_size: 4,
                num_blocks,
                max_waiting: 16,
                kv_dtype: Default::default(),
                micro_batches: MicroBatches::Fixed(1),
                enable_prefix_caching: cache,
                expert_load_metrics: true,
                parallel_choose_min_logits,
            },
        )
        .expect("scheduler")
    }

    /// A greedy request for `max_tokens` tokens, eos ignored.
    fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt_token_ids: prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: true,
            logprobs: None,
            n: 1,
            cache_salt: None,
            constraint: None,
        }
    }

    /// The tokens a request's stream delivers, until it finishes.
    fn collect(mut rx: UnboundedReceiver<Event>) -> Vec<u32> {
        let mut out = Vec::new();
        loop {
            match rx.blocking_recv() {
                Some(Event::Token { token_id, .. }) => out.push(token_id),
                Some(Event::Finished { .. }) => return out,
                Some(Event::Error(e)) | Some(Event::Unavailable(e)) => panic!("failed: {e}"),
                None => panic!("stream ended without finishing"),
            }
        }
    }

    fn run_one(h: &SchedulerHandle, req: Request) -> Vec<u32> {
        collect(h.submit(req).expect("submit"))
    }

    /// `n` pseudo-random token ids below 300 from `seed`.
    fn tokens(seed: u32, n: usize) -> Vec<u32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (x >> 8) % 300
            })
            .collect()
    }

    /// Waits until the scheduler has published that every block is free.
    fn assert_all_blocks_free(h: &SchedulerHandle, total: usize) {
        for _ in 0..500 {
            if h.stats().free_blocks.load(Ordering::Relaxed) == total {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!(
            "blocks leaked: {} free of {total}",
            h.stats().free_blocks.load(Ordering::Relaxed)
        );
    }

    #[test]
    fn a_shared_prefix_is_computed_once_and_outputs_match_no_cache() {
        let prefix = tokens(1, 37);
        let a = [prefix.clone(), vec![5, 6, 7]].concat();
        let b = [prefix.clone(), vec![8, 9]].concat();
        let plain = local_scheduler(false, 64, 4);
        let cached = local_scheduler(true, 64, 4);
        let want_a = run_one(&plain, greedy(a.clone(), 6));
        let want_b = run_one(&plain, greedy(b.clone(), 6));
        assert_eq!(
            plain.stats().prefix_cache_queries.load(Ordering::Relaxed),
            0
        );

        assert_eq!(run_one(&cached, greedy(a.clone(), 6)), want_a);
        let st = cached.stats();
        assert_eq!(st.prefix_cache_queries.load(Ordering::Relaxed), 40);
        assert_eq!(st.prefix_cache_hits.load(Ordering::Relaxed), 0);
        // b shares the 9 full blocks of the prefix (36 of its 39 tokens).
        assert_eq!(run_one(&cached, greedy(b.clone(), 6)), want_b);
        assert_eq!(st.prefix_cache_queries.load(Ordering::Relaxed), 79);
        assert_eq!(st.prefix_cache_hits.load(Ordering::Relaxed), 36);
        // a again: everything but its last block (its last token is recomputed).
        assert_eq!(run_one(&cached, greedy(a.clone(), 6)), want_a);
        assert_eq!(st.prefix_cache_hits.load(Ordering::Relaxed), 72);
        // A prompt extending a's output hits the generated tokens' blocks too.
        let turn2 = [a.clone(), want_a.clone(), vec![11, 12]].concat();
        assert_eq!(
            run_one(&cached, greedy(turn2.clone(), 4)),
            run_one(&plain, greedy(turn2, 4))
        );
        // a's prompt and 5 of its 6 outputs were in the cache: 44 of 45 → 44.
        assert_eq!(st.prefix_cache_hits.load(Ordering::Relaxed), 72 + 44);
        assert_all_blocks_free(&cached, 64);
    }

    #[test]
    fn a_tiny_pool_evicts_cached_blocks_and_outputs_still_match() {
        // 12 blocks of 4: each request (20 + 8 tokens) needs 7.
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| tokens(10 + i, 20)).collect();
        let plain = local_scheduler(false, 12, 1);
        let cached = local_scheduler(true, 12, 1);
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| run_one(&plain, greedy(p.clone(), 8)))
            .collect();
        for round in 0..2 {
            for (p, w) in prompts.iter().zip(&want) {
                assert_eq!(&run_one(&cached, greedy(p.clone(), 8)), w, "round {round}");
                assert_all_blocks_free(&cached, 12);
            }
        }
        // The last prompt, run again at once, hits its 4 full prompt blocks
        // (16 of 20; the last token is always recomputed).
        let before = cached.stats().prefix_cache_hits.load(Ordering::Relaxed);
        assert_eq!(run_one(&cached, greedy(prompts[2].clone(), 8)), want[2]);
        assert_eq!(
            cached.stats().prefix_cache_hits.load(Ordering::Relaxed) - before,
            16
        );
        assert_all_blocks_free(&cached, 12);
    }

    /// Each choice's tokens, until all `n` finish.
    fn collect_n(mut rx: UnboundedReceiver<Event>, n: usize) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); n];
        let mut done = 0;
        while done < n {
            match rx.blocking_recv() {
                Some(Event::Token {
                    index, token_id, ..
                }) => out[index].push(token_id),
                Some(Event::Finished {
                    index,
                    completion_tokens,
                    ..
                }) => {
                    assert_eq!(out[index].len(), completion_tokens);
                    done += 1;
                }
                Some(Event::Error(e)) | Some(Event::Unavailable(e)) => panic!("failed: {e}"),
                None => panic!("stream ended without finishing"),
            }
        }
        out
    }

    fn computed(h: &SchedulerHandle) -> u64 {
        h.stats().computed_tokens.load(Ordering::Relaxed)
    }

    #[test]
    fn n_choices_compute_the_prompt_once_with_and_without_the_cache() {
        let prompt = tokens(5, 37);
        let plain = local_scheduler(false, 64, 4);
        let want = run_one(&plain, greedy(prompt.clone(), 6));
        assert_eq!(computed(&plain), 37 + 5);
        for cache in [false, true] {
            let h = local_scheduler(cache, 64, 4);
            let mut req = greedy(prompt.clone(), 6);
            req.n = 4;
            let got = collect_n(h.submit(req).expect("submit"), 4);
            assert_eq!(got, vec![want.clone(); 4], "cache {cache}");
            // The prompt once, then 5 decodes per choice (each choice's first
            // token comes from the prompt's logits): 57 instead of 4 · 42.
            assert_eq!(computed(&h), 37 + 4 * 5, "cache {cache}");
            assert_all_blocks_free(&h, 64);
        }
    }

    /// A batch of sampling sequences chooses the same tokens on the compute
    /// pool (`choose_all`) as one by one in place, with every filter, a
    /// penalty, logprobs, a grammar-constrained sequence (always in place)
    /// and a fork among them.
    #[test]
    fn a_batch_chosen_in_parallel_matches_the_serial_choices() {
        use epserve_core::structured::Constraint;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_moe_a/f32");
        let engine = Engine::load(&dir).expect("fixture engine");
        let guide = (engine.compile_constraint(Constraint::Regex("[a-z]{3}-[0-9]{3}".into())))
            .expect("compile");
        let requests = || {
            (0..7u64).map(|i| {
                let mut req = greedy(tokens(40 + i as u32, 7 + i as usize), 10);
                req.sampling.temperature = 0.7 + 0.1 * i as f32;
                req.sampling.seed = Some(100 + i);
                match i {
                    1 => req.sampling.top_k = 5,
                    2 => req.sampling.top_p = 0.8,
                    3 => req.sampling.min_p = 0.05,
                    4 => {
                        req.sampling.repetition_penalty = 1.3;
                        req.logprobs = Some(2);
                    }
                    5 => req.n = 2,
                    6 => req.constraint = Some(guide.clone()),
                    _ => {}
                }
                req
            })
        };
        let run = |min_logits: usize| {
            let h = local_scheduler_choosing(false, 128, 8, min_logits);
            let rxs: Vec<_> = (requests().map(|r| (r.n, h.submit(r).expect("submit")))).collect();
            let got: Vec<Vec<Vec<u32>>> =
                (rxs.into_iter()).map(|(n, rx)| collect_n(rx, n)).collect();
            (got, h.stats().parallel_choices.load(Ordering::Relaxed))
        };
        let (serial, none) = run(usize::MAX);
        assert_eq!(none, 0);
        let (parallel, chosen) = run(0);
        assert!(chosen > 0, "nothing was chosen on the pool");
        assert_eq!(parallel, serial);
        assert!(serial.iter().flatten().all(|t| !t.is_empty()));
        assert_eq!(serial[5].len(), 2);
    }

    #[test]
    fn seeded_choices_differ_and_each_is_the_n_1_request_with_seed_plus_index() {
        let h = local_scheduler(true, 64, 4);
        let sampled = |seed: u64, n: usize| {
            let mut req = greedy(tokens(6, 9), 12);
            req.sampling.temperature = 1.0;
            req.sampling.seed = Some(seed);
            req.n = n;
            req
        };
        let got = collect_n(h.submit(sampled(11, 3)).expect("submit"), 3);
        assert_ne!(got[0], got[1]);
        assert_ne!(got[1], got[2]);
        assert_eq!(collect_n(h.submit(sampled(11, 3)).expect("submit"), 3), got);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(&run_one(&h, sampled(11 + i as u64, 1)), g, "choice {i}");
        }
        assert_all_blocks_free(&h, 64);
    }

    #[test]
    fn n_choices_under_preemption_and_few_batch_slots_match_greedy() {
        let prompt = tokens(7, 27);
        let plain = local_scheduler(false, 64, 1);
        let want = run_one(&plain, greedy(prompt.clone(), 16));
        // 16 blocks of 4: four choices of 27 + 16 tokens sharing 6 prompt
        // blocks need 6 + 4 · 5 = 26: some are preempted. With 2 batch slots
        // two choices start without blocks and recompute.
        for (cache, max_seqs) in [(false, 4), (true, 4), (false, 2), (true, 2)] {
            let h = local_scheduler(cache, 16, max_seqs);
            let mut req = greedy(prompt.clone(), 16);
            req.n = 4;
            let got = collect_n(h.submit(req).expect("submit"), 4);
            assert_eq!(
                got,
                vec![want.clone(); 4],
                "cache {cache}, {max_seqs} slots"
            );
            if max_seqs == 4 {
                assert!(h.stats().preemptions.load(Ordering::Relaxed) > 0);
            }
            assert_all_blocks_free(&h, 16);
        }
    }

    #[test]
    fn constrained_sequences_conform_and_survive_preemption() {
        use epserve_core::structured::Constraint;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_moe_a/f32");
        let engine = Arc::new(Engine::load(&dir).expect("fixture engine"));
        let sched = |num_blocks| {
            start(
                engine.clone(),
                SchedulerConfig {
                    max_num_seqs: 4,
                    max_num_batched_tokens: 32,
                    max_model_len: 128,
                    block_size: 4,
                    num_blocks,
                    max_waiting: 16,
                    kv_dtype: Default::default(),
                    micro_batches: MicroBatches::Fixed(1),
                    enable_prefix_caching: false,
                    expert_load_metrics: false,
                    parallel_choose_min_logits: PARALLEL_CHOOSE_MIN_LOGITS,
                },
            )
            .expect("scheduler")
        };
        let rx = "[a-z]{4}-[0-9]{4}-[a-z]{4}";
        let c = engine
            .compile_constraint(Constraint::Regex(rx.into()))
            .expect("compile");
        let req = |p: Vec<u32>| Request {
            constraint: Some(c.clone()),
            ..greedy(p, 16)
        };
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(20 + i, 27)).collect();
        let roomy = sched(256);
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| run_one(&roomy, req(p.clone())))
            .collect();
        for (p, w) in prompts.iter().zip(&want) {
            let text = engine.tokenizer.decode(w, true).expect("decode");
            let b = text.as_bytes();
            assert_eq!(b.len(), 14, "{text:?}");
            assert!(
                b[..4].iter().all(u8::is_ascii_lowercase) && b[4] == b'-',
                "{text:?}"
            );
            assert!(
                b[5..9].iter().all(u8::is_ascii_digit) && b[9] == b'-',
                "{text:?}"
            );
            assert!(b[10..].iter().all(u8::is_ascii_lowercase), "{text:?}");
            // The mask changed what greedy decoding picks.
            assert_ne!(&run_one(&roomy, greedy(p.clone(), w.len())), w);
        }
        // 12 blocks of 4 for four sequences of 27 + up to 14 tokens: some are
        // preempted and recomputed; their matchers must not consume twice.
        let tight = sched(12);
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| tight.submit(req(p.clone())).expect("submit"))
            .collect();
        let got: Vec<Vec<u32>> = rxs.into_iter().map(collect).collect();
        assert_eq!(got, want);
        assert!(
            tight.stats().preemptions.load(Ordering::Relaxed) > 0,
            "no preemption"
        );
        assert_all_blocks_free(&tight, 12);
    }

    /// Four prompts sharing a 24-token prefix through a 16-block cached
    /// scheduler made by `make(cache, num_blocks, max_num_seqs)`: outputs as
    /// without the cache, some preemption, each finds the shared blocks, and
    /// every block is free afterwards. Returns the prompts, their outputs and
    /// the cached scheduler.
    fn shared_prefix_under_preemption(
        make: fn(bool, usize, usize) -> SchedulerHandle,
    ) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, SchedulerHandle) {
        let prefix = tokens(3, 24);
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|i| [prefix.clone(), vec![20 + i, 40 + i, 60 + i]].concat())
            .collect();
        let plain = make(false, 64, 1);
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| run_one(&plain, greedy(p.clone(), 16)))
            .collect();
        // 16 blocks: four sequences of 27 + 16 tokens sharing 6 blocks need
        // 6 + 4 · 5 = 26, so some are preempted (their blocks released to the
        // cache and attached again on readmission).
        let cached = make(true, 16, 4);
        assert_eq!(run_one(&cached, greedy(prompts[0].clone(), 16)), want[0]);
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| cached.submit(greedy(p.clone(), 16)).expect("submit"))
            .collect();
        let got: Vec<Vec<u32>> = rxs.into_iter().map(collect).collect();
        assert_eq!(got, want);
        let st = cached.stats();
        assert!(st.preemptions.load(Ordering::Relaxed) > 0, "no preemption");
        // Each of the four found at least the 6 shared blocks at admission.
        assert!(st.prefix_cache_hits.load(Ordering::Relaxed) >= 4 * 24);
        assert_all_blocks_free(&cached, 16);
        (prompts, want, cached)
    }

    #[test]
    fn preemption_with_shared_blocks_keeps_outputs_and_frees_everything() {
        shared_prefix_under_preemption(local_scheduler);
    }

    /// The qwen3_moe_a fixture with attention split over 2 in-process shards
    /// (blocks of 2 positions, the scheduler's of 4), as attention-workers
    /// split it: the shards follow the scheduler's block table.
    fn sharded_scheduler(cache: bool, num_blocks: usize, max_num_seqs: usize) -> SchedulerHandle {
        use epserve_core::experts::{LoadOptions, LocalDispatcher, load_executor};
        use epserve_core::model::attn_shard::LocalShards;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_moe_a/f32");
        let load = || -> epserve_core::Result<Engine> {
            let cfg = ModelConfig::from_dir(&dir)?;
            let ws = WeightStore::open(&dir)?;
            let experts = load_executor(&cfg, &ws, &LoadOptions::default())?;
            let shards = LocalShards::load(&dir, 2, 1 << 22, 2)?;
            let model = Model::from_store_with(
                cfg,
                &ws,
                Arc::new(LocalDispatcher::new(experts)),
                Some(Arc::new(shards)),
            )?;
            Ok(Engine::from_parts(
                model,
                Tokenizer::from_dir(&dir)?,
                GenerationConfig::from_dir(&dir)?,
                &dir,
            ))
        };
        start(
            Arc::new(load().expect("sharded engine")),
            SchedulerConfig {
                max_num_seqs,
                max_num_batched_tokens: 32,
                max_model_len: 128,
                block_size: 4,
                num_blocks,
                max_waiting: 16,
                kv_dtype: Default::default(),
                micro_batches: MicroBatches::Fixed(1),
                enable_prefix_caching: cache,
                expert_load_metrics: false,
                parallel_choose_min_logits: PARALLEL_CHOOSE_MIN_LOGITS,
            },
        )
        .expect("scheduler")
    }

    #[test]
    fn attention_shards_share_cached_prefixes_through_preemption_and_salts() {
        let (prompts, want, cached) = shared_prefix_under_preemption(sharded_scheduler);
        let st = cached.stats();
        // A salted request shares nothing with unsalted ones; the same salt
        // shares with itself. Outputs never change.
        let salted = |p: &[u32]| Request {
            cache_salt: Some("tenant".into()),
            ..greedy(p.to_vec(), 16)
        };
        let before = st.prefix_cache_hits.load(Ordering::Relaxed);
        assert_eq!(run_one(&cached, salted(&prompts[1])), want[1]);
        assert_eq!(st.prefix_cache_hits.load(Ordering::Relaxed), before);
        assert_eq!(run_one(&cached, salted(&prompts[2])), want[2]);
        assert_eq!(st.prefix_cache_hits.load(Ordering::Relaxed), before + 24);
        assert_all_blocks_free(&cached, 16);
    }
}
