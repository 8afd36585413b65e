//! One request as the scheduler tracks it: its tokens, KV block table,
//! sampler, streaming detokenizer and timing.

use std::time::Instant;

use epserve_core::detok::TextStream;
use epserve_core::engine::{Engine, FinishReason};
use epserve_core::model::kv_cache::SeqCache;
use epserve_core::moe::top_k_indices;
use epserve_core::sampling::{Sampler, log_softmax};
use epserve_core::structured::Guide;
use tokio::sync::mpsc::UnboundedSender;

use super::{Event, Request, TokenLogprob};
use crate::metrics as m;

/// A sampled token and its logprobs, or why none could be chosen.
pub(super) type Choice = Result<(u32, Option<TokenLogprob>), String>;

pub(super) struct Seq {
    pub id: u64,
    /// Which of the request's `n` choices this is.
    pub index: usize,
    /// Choices still to be forked from this one once its prompt is computed
    /// (`n - 1` for choice 0 until then, else 0).
    pub pending_forks: usize,
    pub req: Request,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose keys/values are in the cache.
    pub num_computed: usize,
    /// Tokens scheduled in the current step.
    pub step_take: usize,
    pub cache: SeqCache,
    pub sampler: Sampler,
    pub text: TextStream,
    pub tx: UnboundedSender<Event>,
    pub arrived: Instant,
    pub first_token: Option<Instant>,
    pub preemptions: u32,
    /// Why some of its tokens were computed in degraded mode (a lost expert
    /// rerouted), if they were.
    pub degraded: Option<String>,
    /// The grammar's matcher when the output is constrained (structured
    /// output): it has consumed exactly the generated tokens, so a
    /// preempted sequence resumes where it was.
    pub guide: Option<Guide>,
}

impl Seq {
    pub fn new(id: u64, req: Request, tx: UnboundedSender<Event>) -> Self {
        let mut cache = SeqCache::new();
        if let Some(salt) = &req.cache_salt {
            cache.set_salt(salt);
        }
        Seq {
            id,
            index: 0,
            pending_forks: req.n.saturating_sub(1),
            tokens: req.prompt_token_ids.clone(),
            num_computed: 0,
            step_take: 0,
            cache,
            sampler: Sampler::new(req.sampling.clone()),
            text: TextStream::new(&req.prompt_token_ids, &req.stop),
            tx,
            arrived: Instant::now(),
            first_token: None,
            preemptions: 0,
            degraded: None,
            guide: req.constraint.as_ref().map(|c| c.start()),
            req,
        }
    }

    /// Choice `index` of the same request, before its first token: the
    /// prompt, its own sampler (`seed + index`), no KV yet (the caller forks
    /// the prompt's blocks or lets it recompute them).
    pub fn child(&self, index: usize) -> Self {
        let mut req = self.req.clone();
        req.sampling = self.req.sampling.for_choice(index);
        Seq {
            // Each choice has its own matcher.
            guide: req.constraint.as_ref().map(|c| c.start()),
            id: self.id,
            index,
            pending_forks: 0,
            tokens: req.prompt_token_ids.clone(),
            num_computed: 0,
            step_take: 0,
            cache: SeqCache::new(),
            sampler: Sampler::new(req.sampling.clone()),
            text: TextStream::new(&req.prompt_token_ids, &req.stop),
            tx: self.tx.clone(),
            arrived: self.arrived,
            first_token: None,
            preemptions: 0,
            degraded: self.degraded.clone(),
            req,
        }
    }

    fn generated(&self) -> &[u32] {
        &self.tokens[self.req.prompt_token_ids.len()..]
    }

    /// Samples the next token from this step's logits and streams it.
    /// Returns true when the request is finished.
    pub fn on_logits(&mut self, engine: &Engine, logits: &[f32], max_model_len: usize) -> bool {
        let choice = self.choose(logits);
        self.on_token(engine, choice, max_model_len)
    }

    /// The next token from this step's logits (the grammar's mask, the
    /// sampler) and its logprobs when asked, without streaming it or
    /// changing anything but the sampler's RNG: the part of
    /// [`Seq::on_logits`] that the scheduler runs for all sequences in
    /// parallel.
    pub fn choose(&mut self, logits: &[f32]) -> Choice {
        let n_prompt = self.req.prompt_token_ids.len();
        // A copy of the row (600 KB at a 152k vocabulary) only for what
        // changes logits: a grammar's mask, the logit processors.
        let tok = if self.guide.is_some() || self.sampler.adjusts() {
            let mut work = logits.to_vec();
            if let Some(g) = self.guide.as_mut()
                && let Err(e) = g.apply(&mut work)
            {
                return Err(format!("structured output failed: {e}"));
            }
            self.sampler.adjust(
                &mut work,
                &self.req.prompt_token_ids,
                &self.tokens[n_prompt..],
            );
            self.sampler.pick(&work)
        } else {
            self.sampler.pick(logits)
        };
        let logprob = self.req.logprobs.map(|n| {
            let lp = log_softmax(logits);
            let mut top = Vec::new();
            top_k_indices(&lp, n, &mut top);
            TokenLogprob {
                token_id: tok,
                logprob: lp[tok as usize],
                top: top.into_iter().map(|i| (i, lp[i as usize])).collect(),
            }
        });
        Ok((tok, logprob))
    }

    /// Appends the token [`Seq::choose`] picked and streams it (or fails the
    /// request with its error). Returns true when the request is finished.
    pub fn on_token(&mut self, engine: &Engine, choice: Choice, max_model_len: usize) -> bool {
        let n_prompt = self.req.prompt_token_ids.len();
        let (tok, logprob) = match choice {
            Ok(c) => c,
            Err(e) => return self.fail(e),
        };
        self.tokens.push(tok);
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
            if self.index == 0 {
                m::ttft(now.duration_since(self.arrived).as_secs_f64());
            }
        }
        let n_gen = self.generated().len();
        let mut is_eos = !self.req.ignore_eos && engine.eos_ids().contains(&tok);
        let is_stop_token = self.req.stop_token_ids.contains(&tok);
        // The grammar allowed this token: an end-of-sequence token where it
        // accepts (that ends the output even with ignore_eos: nothing may
        // follow), else a token it consumes; complete, it ends the output.
        let mut grammar_done = false;
        if let Some(g) = self.guide.as_mut() {
            if engine.eos_ids().contains(&tok) {
                is_eos = true;
            } else {
                match g.commit(tok) {
                    Ok(done) => grammar_done = done,
                    Err(e) => return self.fail(format!("structured output failed: {e}")),
                }
            }
        }
        let delta = match self.text.push(&engine.tokenizer, tok) {
            Ok(d) => d,
            Err(e) => {
                let _ = self.tx.send(Event::Error(e.to_string()));
                m::request_finished("error");
                return true;
            }
        };
        let mut reason = None;
        if is_eos || is_stop_token || delta.stopped || grammar_done {
            reason = Some(FinishReason::Stop);
        } else if n_gen >= self.req.max_tokens || self.tokens.len() >= max_model_len {
            reason = Some(FinishReason::Length);
        }
        let mut text = delta.text;
        if reason.is_some() {
            match self.text.finish(&engine.tokenizer) {
                Ok(d) => text.push_str(&d.text),
                Err(e) => {
                    let _ = self.tx.send(Event::Error(e.to_string()));
                    m::request_finished("error");
                    return true;
                }
            }
        }
        let _ = self.tx.send(Event::Token {
            index: self.index,
            token_id: tok,
            text,
            logprob,
        });
        if reason.is_none()
            && let Some(g) = self.guide.as_mut()
        {
            // The next mask is computed while the next step's forward pass runs.
            g.prefetch();
        }
        match reason {
            Some(reason) => {
                let _ = self.tx.send(Event::Finished {
                    index: self.index,
                    reason,
                    prompt_tokens: n_prompt,
                    completion_tokens: n_gen,
                    degraded: self.degraded.clone(),
                });
                if self.degraded.is_some() {
                    metrics::counter!("epserve_degraded_requests_total").increment(1);
                }
                if self.index > 0 {
                    // The request (its prompt, latency) is counted by choice 0.
                    metrics::counter!("epserve_generation_tokens_total").increment(n_gen as u64);
                    return true;
                }
                let e2e = now.duration_since(self.arrived).as_secs_f64();
                let ttft = self
                    .first_token
                    .map(|f| f.duration_since(self.arrived).as_secs_f64())
                    .unwrap_or(e2e);
                m::request_done(e2e, ttft, n_prompt, n_gen);
                if let Some(g) = &self.guide {
                    let st = g.stats();
                    tracing::debug!(
                        id = self.id,
                        masks = st.masks,
                        compute_us = st.compute.as_micros() as u64,
                        waited_us = st.waited.as_micros() as u64,
                        "structured output masks"
                    );
                }
                true
            }
            None => false,
        }
    }

    /// Ends the request with an internal error.
    fn fail(&mut self, msg: String) -> bool {
        tracing::error!(id = self.id, error = %msg, "request failed");
        let _ = self.tx.send(Event::Error(msg));
        m::request_finished("error");
        true
    }
}
