//! Turning scheduler events into OpenAI responses: SSE chunks for streaming
//! (`data: {...}` … `data: [DONE]`, optional usage chunk) or one JSON body.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use epserve_core::engine::{Engine, FinishReason};
use futures_util::stream;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::tools::{self, HermesParser, Pieces, ToolParse};
use crate::scheduler::{Event, TokenLogprob};

/// Which endpoint's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// Per-response constants.
pub struct Ctx {
    pub engine: Arc<Engine>,
    pub model: String,
    pub kind: Kind,
    pub n_prompt: usize,
    /// Choices the request asked for (`n`).
    pub n: usize,
    pub created: u64,
    pub id: String,
    /// Parse `<tool_call>` blocks into `tool_calls` (chat with tools).
    pub tools: Option<ToolParse>,
}

/// A fresh response id.
pub fn new_id(kind: Kind) -> String {
    let r: u64 = rand::random();
    match kind {
        Kind::Completion => format!("cmpl-{r:016x}"),
        Kind::Chat => format!("chatcmpl-{r:016x}"),
    }
}

fn usage(n_prompt: usize, n_gen: usize) -> Value {
    json!({"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen})
}

fn token_text(engine: &Engine, id: u32) -> String {
    engine.tokenizer.decode(&[id], false).unwrap_or_default()
}

/// Logprobs accumulated for a non-streaming response or one chunk.
#[derive(Default)]
struct Logprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top: Vec<Vec<(String, f32)>>,
    offsets: Vec<usize>,
}

impl Logprobs {
    fn push(&mut self, engine: &Engine, lp: &TokenLogprob, text_offset: usize) {
        self.tokens.push(token_text(engine, lp.token_id));
        self.token_logprobs.push(lp.logprob);
        self.top.push(
            lp.top
                .iter()
                .map(|(id, l)| (token_text(engine, *id), *l))
                .collect(),
        );
        self.offsets.push(text_offset);
    }

    fn to_json(&self, kind: Kind) -> Value {
        match kind {
            Kind::Completion => {
                let top: Vec<Value> = self
                    .top
                    .iter()
                    .map(|t| Value::Object(t.iter().map(|(s, l)| (s.clone(), json!(l))).collect()))
                    .collect();
                json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                       "top_logprobs": top, "text_offset": self.offsets})
            }
            Kind::Chat => {
                let content: Vec<Value> = self
                    .tokens
                    .iter()
                    .zip(&self.token_logprobs)
                    .zip(&self.top)
                    .map(|((t, l), top)| {
                        json!({"token": t, "logprob": l, "bytes": t.as_bytes(),
                               "top_logprobs": top.iter().map(|(s, l)| json!({"token": s, "logprob": l, "bytes": s.as_bytes()})).collect::<Vec<_>>()})
                    })
                    .collect();
                json!({"content": content})
            }
        }
    }
}

fn choice(
    ctx: &Ctx,
    index: usize,
    text: &str,
    logprobs: Option<Value>,
    finish: Option<&str>,
    first: bool,
) -> Value {
    match ctx.kind {
        Kind::Completion => {
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        }
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if !text.is_empty() || (first && finish.is_none()) {
                delta.insert("content".into(), json!(text));
            }
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        }
    }
}

/// A streamed chat choice from what the tool-call parser released: content
/// and/or complete tool calls. None when there is nothing to send.
fn tool_choice_delta(
    index: usize,
    pieces: &Pieces,
    logprobs: Option<Value>,
    finish: Option<&str>,
    first: bool,
) -> Option<Value> {
    let mut delta = serde_json::Map::new();
    if first {
        delta.insert("role".into(), json!("assistant"));
    }
    if !pieces.content.is_empty() || (first && finish.is_none() && pieces.calls.is_empty()) {
        delta.insert("content".into(), json!(pieces.content));
    }
    if !pieces.calls.is_empty() {
        let calls: Vec<Value> = pieces.calls.iter().map(|c| c.to_json(true)).collect();
        delta.insert("tool_calls".into(), json!(calls));
    }
    if delta.is_empty() && logprobs.is_none() && finish.is_none() {
        return None;
    }
    Some(json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}))
}

fn chunk(ctx: &Ctx, choices: Vec<Value>, usage: Option<Value>) -> Value {
    let object = match ctx.kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    };
    let mut v = json!({"id": ctx.id, "object": object, "created": ctx.created, "model": ctx.model, "choices": choices});
    if let Some(u) = usage {
        v["usage"] = u;
    }
    v
}

struct StreamState {
    ctx: Ctx,
    rx: UnboundedReceiver<Event>,
    pending: VecDeque<String>,
    done: bool,
    /// Per choice: nothing sent for it yet.
    first: Vec<bool>,
    /// Choices finished so far, and their completion tokens.
    finished: usize,
    include_usage: bool,
    n_gen: usize,
    /// Per choice: the tool-call parser (chat with tools).
    parsers: Vec<Option<HermesParser>>,
}

/// An SSE response fed by the scheduler. Dropping it (client gone) drops the
/// receiver, which cancels the request.
pub fn stream(ctx: Ctx, rx: UnboundedReceiver<Event>, include_usage: bool) -> Response {
    let parsers = (0..ctx.n.max(1))
        .map(|_| match ctx.kind {
            Kind::Chat => ctx.tools.map(HermesParser::new),
            Kind::Completion => None,
        })
        .collect();
    let st = StreamState {
        parsers,
        first: vec![true; ctx.n.max(1)],
        ctx,
        rx,
        pending: VecDeque::new(),
        done: false,
        finished: 0,
        include_usage,
        n_gen: 0,
    };
    let s = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(data) = st.pending.pop_front() {
                return Some((Ok::<_, Infallible>(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            match st.rx.recv().await {
                Some(Event::Token {
                    index,
                    text,
                    logprob,
                    ..
                }) => {
                    let lp = logprob.map(|lp| {
                        let mut l = Logprobs::default();
                        l.push(&st.ctx.engine, &lp, 0);
                        l.to_json(st.ctx.kind)
                    });
                    if let Some(Some(p)) = st.parsers.get_mut(index) {
                        let first = st.first.get(index).copied().unwrap_or(false);
                        let pieces = p.push(&text);
                        if let Some(c) = tool_choice_delta(index, &pieces, lp, None, first) {
                            if let Some(f) = st.first.get_mut(index) {
                                *f = false;
                            }
                            st.pending
                                .push_back(chunk(&st.ctx, vec![c], None).to_string());
                        }
                        continue;
                    }
                    let Some(first) = st.first.get_mut(index) else {
                        continue;
                    };
                    let was_first = std::mem::replace(first, false);
                    if text.is_empty() && lp.is_none() && !was_first {
                        continue;
                    }
                    let c = choice(&st.ctx, index, &text, lp, None, was_first);
                    st.pending
                        .push_back(chunk(&st.ctx, vec![c], None).to_string());
                }
                Some(Event::Finished {
                    index,
                    reason,
                    completion_tokens,
                    degraded,
                    ..
                }) => {
                    let mut reason = reason.as_str();
                    if let Some(Some(p)) = st.parsers.get_mut(index) {
                        let first = st.first.get(index).copied().unwrap_or(false);
                        let pieces = p.finish();
                        if let Some(c) = tool_choice_delta(index, &pieces, None, None, first) {
                            if let Some(f) = st.first.get_mut(index) {
                                *f = false;
                            }
                            st.pending
                                .push_back(chunk(&st.ctx, vec![c], None).to_string());
                        }
                        if p.called() {
                            reason = "tool_calls";
                        }
                    }
                    let was_first = st
                        .first
                        .get_mut(index)
                        .map(|f| std::mem::replace(f, false))
                        .unwrap_or(false);
                    let c = choice(&st.ctx, index, "", None, Some(reason), was_first);
                    let mut last = chunk(&st.ctx, vec![c], None);
                    if let Some(why) = degraded {
                        last["degraded"] = degraded_json(&why);
                    }
                    st.pending.push_back(last.to_string());
                    st.n_gen += completion_tokens;
                    st.finished += 1;
                    if st.finished < st.ctx.n {
                        continue;
                    }
                    // Usage counts the prompt once and every choice's tokens.
                    if st.include_usage {
                        st.pending.push_back(
                            chunk(&st.ctx, vec![], Some(usage(st.ctx.n_prompt, st.n_gen)))
                                .to_string(),
                        );
                    }
                    st.pending.push_back("[DONE]".into());
                    st.done = true;
                }
                Some(Event::Error(msg)) => {
                    let e = ApiError::internal(msg);
                    st.pending.push_back(e.body().to_string());
                    st.pending.push_back("[DONE]".into());
                    st.done = true;
                }
                Some(Event::Unavailable(msg)) => {
                    let e = ApiError::cluster_unavailable(msg);
                    st.pending.push_back(e.body().to_string());
                    st.pending.push_back("[DONE]".into());
                    st.done = true;
                }
                None => {
                    let e = ApiError::internal("the request was dropped by the scheduler");
                    st.pending.push_back(e.body().to_string());
                    st.done = true;
                }
            }
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default()).into_response()
}

/// Waits for the whole completion and returns one JSON body.
pub async fn collect(ctx: Ctx, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    /// One choice as it accumulates.
    #[derive(Default)]
    struct Acc {
        text: String,
        lps: Option<Logprobs>,
        finish: Option<FinishReason>,
    }
    let mut acc: Vec<Acc> = (0..ctx.n.max(1)).map(|_| Acc::default()).collect();
    let (mut n_gen, mut finished, mut degraded) = (0usize, 0usize, None::<String>);
    while finished < acc.len() {
        match rx.recv().await {
            Some(Event::Token {
                index,
                text: t,
                logprob,
                ..
            }) => {
                let Some(a) = acc.get_mut(index) else {
                    continue;
                };
                if let Some(lp) = logprob {
                    a.lps.get_or_insert_with(Logprobs::default).push(
                        &ctx.engine,
                        &lp,
                        a.text.len(),
                    );
                }
                a.text.push_str(&t);
            }
            Some(Event::Finished {
                index,
                reason,
                completion_tokens,
                degraded: d,
                ..
            }) => {
                if let Some(a) = acc.get_mut(index)
                    && a.finish.is_none()
                {
                    a.finish = Some(reason);
                    n_gen += completion_tokens;
                    finished += 1;
                    degraded = degraded.or(d);
                }
            }
            // The scheduler counted these requests already.
            Some(Event::Error(msg)) => return Err(ApiError::internal(msg).counted()),
            Some(Event::Unavailable(msg)) => {
                return Err(ApiError::cluster_unavailable(msg).counted());
            }
            None => {
                return Err(ApiError::internal(
                    "the request was dropped by the scheduler",
                ));
            }
        }
    }
    let choices: Vec<Value> = acc
        .into_iter()
        .enumerate()
        .map(|(index, a)| {
            let lp = a.lps.map(|l| l.to_json(ctx.kind));
            let finish = a.finish.map(|f| f.as_str());
            match ctx.kind {
                Kind::Completion => {
                    json!({"index": index, "text": a.text, "logprobs": lp, "finish_reason": finish})
                }
                Kind::Chat => {
                    let mut message = json!({"role": "assistant", "content": a.text});
                    let mut reason = finish;
                    if let Some(mode) = ctx.tools {
                        let (content, calls) = tools::parse_output(&a.text, mode);
                        message["content"] = json!(content);
                        if !calls.is_empty() {
                            let calls: Vec<Value> =
                                calls.iter().map(|c| c.to_json(false)).collect();
                            message["tool_calls"] = json!(calls);
                            reason = Some("tool_calls");
                        }
                    }
                    json!({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
                }
            }
        })
        .collect();
    let object = match ctx.kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    let mut body = json!({
        "id": ctx.id, "object": object, "created": ctx.created, "model": ctx.model,
        "choices": choices, "usage": usage(ctx.n_prompt, n_gen),
    });
    if let Some(why) = degraded {
        body["degraded"] = degraded_json(&why);
    }
    Ok(axum::Json(body).into_response())
}

/// What a response says when some of its tokens were computed with a lost
/// expert's weight moved to the token's live experts (`--on-expert-loss
/// reroute`).
fn degraded_json(why: &str) -> Value {
    json!({
        "reason": "expert_loss_rerouted",
        "message": format!("some tokens were computed without an unavailable expert (top-k renormalized over the live ones): {why}"),
    })
}
