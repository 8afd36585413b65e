//! Tool calling on `/v1/chat/completions`, as vLLM does it for Hermes-style
//! models (Qwen2.5, Qwen3): validation of `tools` / `tool_choice` /
//! `parallel_tool_calls`, the parser that turns the model's
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks back
//! into OpenAI `tool_calls` (one pass for a whole text, incremental for
//! streaming: both run the same state machine, so a streamed response
//! reassembles into exactly the non-streamed one), and the Lark grammar that
//! forces a call for `tool_choice: "required"` or a named function.

use epserve_core::loader::tokenizer::python_json;
use serde_json::{Map, Value, json};

use super::error::ApiError;

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;
/// Longest tool name in bytes.
pub const MAX_TOOL_NAME: usize = 256;

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The model may not call tools: its output is plain content.
    None,
    /// The model decides; `<tool_call>` blocks in its output are parsed.
    Auto,
    /// At least one call (of any tool), enforced with a grammar.
    Required,
    /// One call of this tool, enforced with a grammar.
    Named(String),
}

/// One declared tool.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    /// The JSON schema of the arguments (`None`: any object).
    pub parameters: Option<Value>,
}

/// A request's validated tool settings.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    /// The tools as the client wrote them, for the chat template.
    pub template_tools: Vec<Value>,
    pub specs: Vec<ToolSpec>,
    pub choice: Choice,
    pub parallel: bool,
}

/// What the response side needs: parse `<tool_call>` blocks out of the output.
#[derive(Debug, Clone, Copy)]
pub struct ToolParse {
    /// `parallel_tool_calls`: when false, only the first call is returned.
    pub parallel: bool,
}

impl ToolRequest {
    /// How the output is parsed (`None` for `tool_choice: "none"`).
    pub fn parse_mode(&self) -> Option<ToolParse> {
        (self.choice != Choice::None).then_some(ToolParse {
            parallel: self.parallel,
        })
    }
}

/// Validates `tools`, `tool_choice` and `parallel_tool_calls`. `Ok(None)`: no
/// tools (and `tool_choice` absent or `"none"`).
pub fn parse_request(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolRequest>, ApiError> {
    let tools = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(a),
        Some(_) => {
            return Err(ApiError::bad_param(
                "tools",
                "tools must be an array of {\"type\": \"function\", \"function\": {...}} objects",
            ));
        }
    };
    let choice_param = "tool_choice";
    let choice = match tool_choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(ApiError::bad_param(
                    choice_param,
                    format!(
                        "tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got \"{other}\""
                    ),
                ));
            }
        }),
        Some(Value::Object(o)) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::bad_param(
                    choice_param,
                    "a tool_choice object must have \"type\": \"function\"",
                ));
            }
            match o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
            {
                Some(name) => Some(Choice::Named(name.to_string())),
                None => {
                    return Err(ApiError::bad_param(
                        choice_param,
                        "a tool_choice object must name the function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ));
                }
            }
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                choice_param,
                "tool_choice must be a string or an object",
            ));
        }
    };
    let Some(tools) = tools else {
        return match choice {
            None | Some(Choice::None) => Ok(None),
            Some(_) => Err(ApiError::bad_param(
                choice_param,
                "tool_choice other than \"none\" requires tools",
            )),
        };
    };
    if tools.is_empty() {
        return Err(ApiError::bad_param(
            "tools",
            "tools must not be empty (leave the field out instead)",
        ));
    }
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::bad_param(
            "tools",
            format!(
                "at most {MAX_TOOLS} tools may be given, got {}",
                tools.len()
            ),
        ));
    }
    let mut specs: Vec<ToolSpec> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Some(t) = t.as_object() else {
            return Err(ApiError::bad_param(&p, format!("{p} must be an object")));
        };
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad_param(
                &format!("{p}.type"),
                format!("{p}.type must be \"function\" (the only tool type supported)"),
            ));
        }
        let fp = format!("{p}.function");
        let Some(f) = t.get("function").and_then(Value::as_object) else {
            return Err(ApiError::bad_param(&fp, format!("{fp} must be an object")));
        };
        let name = match f.get("name") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            _ => {
                return Err(ApiError::bad_param(
                    &format!("{fp}.name"),
                    format!("{fp}.name must be a non-empty string"),
                ));
            }
        };
        if name.len() > MAX_TOOL_NAME || name.chars().any(char::is_control) {
            return Err(ApiError::bad_param(
                &format!("{fp}.name"),
                format!(
                    "{fp}.name must be at most {MAX_TOOL_NAME} bytes without control characters"
                ),
            ));
        }
        if specs.iter().any(|s| s.name == name) {
            return Err(ApiError::bad_param(
                &format!("{fp}.name"),
                format!("tool names must be unique: '{name}' is declared twice"),
            ));
        }
        match f.get("description") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(_) => {
                return Err(ApiError::bad_param(
                    &format!("{fp}.description"),
                    format!("{fp}.description must be a string"),
                ));
            }
        }
        match f.get("strict") {
            None | Some(Value::Null) | Some(Value::Bool(_)) => {}
            Some(_) => {
                return Err(ApiError::bad_param(
                    &format!("{fp}.strict"),
                    format!("{fp}.strict must be a boolean"),
                ));
            }
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            Some(_) => {
                return Err(ApiError::bad_param(
                    &format!("{fp}.parameters"),
                    format!("{fp}.parameters must be a JSON schema object"),
                ));
            }
        };
        specs.push(ToolSpec { name, parameters });
    }
    let choice = choice.unwrap_or(Choice::Auto);
    if let Choice::Named(n) = &choice
        && !specs.iter().any(|s| &s.name == n)
    {
        return Err(ApiError::bad_param(
            choice_param,
            format!("tool_choice names the function '{n}', which is not among the tools"),
        ));
    }
    Ok(Some(ToolRequest {
        template_tools: tools.clone(),
        specs,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

/// A Lark grammar (llguidance's dialect, `%json` for the arguments) that
/// admits only what the choice asks for: for `Required`, one or more calls
/// (only one when `parallel_tool_calls` is false) of any tool; for `Named`,
/// one call of that tool. `None` for `Auto` / `None`.
///
/// Each call is `<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>`
/// with ARGS valid against the tool's `parameters`, written compactly with
/// `", "` / `": "` separators (the form Hermes-style templates render calls in).
pub fn grammar(req: &ToolRequest) -> Option<String> {
    let tools: Vec<&ToolSpec> = match &req.choice {
        Choice::None | Choice::Auto => return None,
        Choice::Required => req.specs.iter().collect(),
        Choice::Named(n) => req.specs.iter().filter(|s| &s.name == n).collect(),
    };
    let mut g = String::new();
    let many = req.choice == Choice::Required && req.parallel;
    g.push_str(if many {
        "start: call (\"\\n\" call)*\n"
    } else {
        "start: call\n"
    });
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": t.parameters.clone().unwrap_or_else(|| json!({"type": "object"})),
            },
            "required": ["name", "arguments"],
            "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        g.push_str(&format!(
            "call_{i}: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n"
        ));
    }
    Some(g)
}

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub index: usize,
    pub id: String,
    pub name: String,
    /// The arguments as a JSON string (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl ToolCall {
    /// The OpenAI `tool_calls[]` element (`with_index` for stream deltas).
    pub fn to_json(&self, with_index: bool) -> Value {
        let mut v = json!({"id": self.id, "type": "function",
                           "function": {"name": self.name, "arguments": self.arguments}});
        if with_index {
            v["index"] = json!(self.index);
        }
        v
    }
}

/// What one step of the parser produced.
#[derive(Debug, Default, PartialEq)]
pub struct Pieces {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// A fresh tool-call id.
fn call_id() -> String {
    let a: u64 = rand::random();
    let b: u32 = rand::random();
    format!("call_{a:016x}{b:08x}")
}

/// `{"name": ..., "arguments": ...}` → (name, arguments JSON string); `None`
/// for anything else (the text then stays content).
fn parse_call(inner: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(inner.trim()).ok()?;
    let o: &Map<String, Value> = v.as_object()?;
    let name = o.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let args = o
        .get("arguments")
        .or_else(|| o.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let args = match args {
        // A model that wrote the arguments as a JSON string: pass it on.
        Value::String(s) => s,
        v => python_json(&v),
    };
    Some((name.to_string(), args))
}

/// The Hermes `<tool_call>` parser. Text outside calls is content; a call
/// whose body is not `{"name": ..., "arguments": ...}` JSON stays content
/// verbatim (tags included). Once any call was found, whitespace-only
/// content at the end is dropped (so `content` is null for a reply that is
/// only calls); content that could still be the start of a `<tool_call>` tag
/// is held back until it is decided. A final call without its closing tag
/// (the model stopped right after the JSON) is still a call.
#[derive(Debug)]
pub struct HermesParser {
    mode: ToolParse,
    buf: String,
    in_call: bool,
    /// Content whitespace not yet passed on (it is dropped if nothing but
    /// calls and whitespace follow).
    ws: String,
    calls: usize,
}

impl HermesParser {
    pub fn new(mode: ToolParse) -> Self {
        HermesParser {
            mode,
            buf: String::new(),
            in_call: false,
            ws: String::new(),
            calls: 0,
        }
    }

    /// Whether any call was produced so far.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    fn content(&mut self, s: &str, out: &mut Pieces) {
        let body = s.trim_end();
        if body.is_empty() {
            self.ws.push_str(s);
            return;
        }
        out.content.push_str(&self.ws);
        self.ws.clear();
        out.content.push_str(body);
        self.ws.push_str(&s[body.len()..]);
    }

    fn call(&mut self, inner: &str, closed: bool, out: &mut Pieces) {
        match parse_call(inner) {
            Some((name, arguments)) => {
                if self.calls == 0 || self.mode.parallel {
                    out.calls.push(ToolCall {
                        index: self.calls,
                        id: call_id(),
                        name,
                        arguments,
                    });
                }
                self.calls += 1;
            }
            None => {
                let raw = format!("{START}{inner}{}", if closed { END } else { "" });
                self.content(&raw, out);
            }
        }
    }

    /// Feeds more output text.
    pub fn push(&mut self, text: &str) -> Pieces {
        let mut out = Pieces::default();
        self.buf.push_str(text);
        loop {
            if self.in_call {
                let Some(p) = self.buf.find(END) else { break };
                let inner = self.buf[..p].to_string();
                self.buf.drain(..p + END.len());
                self.in_call = false;
                self.call(&inner, true, &mut out);
            } else if let Some(p) = self.buf.find(START) {
                let before = self.buf[..p].to_string();
                self.buf.drain(..p + START.len());
                self.in_call = true;
                self.content(&before, &mut out);
            } else {
                // Hold back a tail that may be the start of `<tool_call>`.
                let keep = (1..START.len())
                    .rev()
                    .find(|&k| {
                        self.buf.len() >= k
                            && self.buf.is_char_boundary(self.buf.len() - k)
                            && START.starts_with(&self.buf[self.buf.len() - k..])
                    })
                    .unwrap_or(0);
                let cut = self.buf.len() - keep;
                let done = self.buf[..cut].to_string();
                self.buf.drain(..cut);
                self.content(&done, &mut out);
                break;
            }
        }
        out
    }

    /// The end of the output: whatever is still held back.
    pub fn finish(&mut self) -> Pieces {
        let mut out = Pieces::default();
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            self.call(&rest, false, &mut out);
        } else {
            self.content(&rest, &mut out);
        }
        if self.calls == 0 {
            out.content.push_str(&std::mem::take(&mut self.ws));
        }
        out
    }
}

/// Parses a whole output: (content, null when empty; the calls).
pub fn parse_output(text: &str, mode: ToolParse) -> (Option<String>, Vec<ToolCall>) {
    let mut p = HermesParser::new(mode);
    let mut a = p.push(text);
    let b = p.finish();
    a.content.push_str(&b.content);
    a.calls.extend(b.calls);
    let content = (!a.content.is_empty()).then_some(a.content);
    (content, a.calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAR: ToolParse = ToolParse { parallel: true };

    fn req(tools: Value, choice: Option<Value>) -> Result<Option<ToolRequest>, ApiError> {
        parse_request(Some(&tools), choice.as_ref(), None)
    }

    fn add() -> Value {
        json!([{"type": "function", "function": {"name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
               {"type": "function", "function": {"name": "now"}}])
    }

    fn param_of(e: ApiError) -> String {
        e.body()["error"]["param"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    #[test]
    fn validation() {
        let r = req(add(), None).expect("ok").expect("some");
        assert_eq!(r.choice, Choice::Auto);
        assert!(r.parallel);
        assert_eq!(r.specs.len(), 2);
        assert!(r.specs[1].parameters.is_none());
        let r = req(
            add(),
            Some(json!({"type": "function", "function": {"name": "now"}})),
        )
        .expect("ok")
        .expect("some");
        assert_eq!(r.choice, Choice::Named("now".into()));
        assert!(
            parse_request(None, None, Some(false))
                .expect("ok")
                .is_none()
        );
        assert!(
            parse_request(None, Some(&json!("none")), None)
                .expect("ok")
                .is_none()
        );

        let bad = [
            (json!([]), None, "tools"),
            (json!({"type": "function"}), None, "tools"),
            (json!([{"type": "retrieval"}]), None, "tools[0].type"),
            (json!([{"type": "function"}]), None, "tools[0].function"),
            (
                json!([{"type": "function", "function": {"name": ""}}]),
                None,
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a"}},
                       {"type": "function", "function": {"name": "a"}}]),
                None,
                "tools[1].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": "x"}}]),
                None,
                "tools[0].function.parameters",
            ),
            (add(), Some(json!("sometimes")), "tool_choice"),
            (
                add(),
                Some(json!({"type": "function", "function": {"name": "mul"}})),
                "tool_choice",
            ),
            (add(), Some(json!({"type": "function"})), "tool_choice"),
            (add(), Some(json!(3)), "tool_choice"),
        ];
        for (tools, choice, param) in bad {
            let e = req(tools.clone(), choice.clone()).expect_err("must fail");
            assert_eq!(param_of(e), param, "{tools} {choice:?}");
        }
        let e = parse_request(None, Some(&json!("required")), None).expect_err("no tools");
        assert_eq!(param_of(e), "tool_choice");
    }

    #[test]
    fn whole_output() {
        let (c, calls) = parse_output(
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,\"b\":[2, 3]}}\n</tool_call>",
            PAR,
        );
        assert_eq!(c, None);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "add");
        assert_eq!(calls[0].arguments, "{\"a\": 1, \"b\": [2, 3]}");
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29);

        // Text around, two calls, whitespace between, non-ASCII kept.
        let text = "Let me check.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n";
        let (c, calls) = parse_output(text, PAR);
        assert_eq!(c.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, "{\"city\": \"Zürich\"}");
        assert_eq!((calls[1].index, calls[1].name.as_str()), (1, "now"));
        assert_ne!(calls[0].id, calls[1].id);

        // parallel_tool_calls false: the first call only.
        let (_, calls) = parse_output(text, ToolParse { parallel: false });
        assert_eq!(calls.len(), 1);

        // No calls: the text unchanged, trailing whitespace included.
        let (c, calls) = parse_output("plain <tool answer>\n", PAR);
        assert_eq!(c.as_deref(), Some("plain <tool answer>\n"));
        assert!(calls.is_empty());
        assert_eq!(parse_output("", PAR).0, None);

        // Malformed calls stay content, verbatim; good ones still parse.
        let text = "a<tool_call>\n{\"name\": \"x\", \"arguments\": {oops}\n</tool_call>b<tool_call>{\"arguments\": {}}</tool_call>";
        let (c, calls) = parse_output(text, PAR);
        assert_eq!(c.as_deref(), Some(text));
        assert!(calls.is_empty());
        let text = "<tool_call>[1]</tool_call><tool_call>{\"name\": \"n\"}</tool_call>";
        let (c, calls) = parse_output(text, PAR);
        assert_eq!(c.as_deref(), Some("<tool_call>[1]</tool_call>"));
        assert_eq!(calls[0].arguments, "{}");
        assert_eq!(calls[0].index, 0);

        // Unclosed final call: a call if its JSON is complete, else content.
        let (c, calls) = parse_output("<tool_call>\n{\"name\": \"n\", \"arguments\": {}}\n", PAR);
        assert_eq!((c, calls.len()), (None, 1));
        let (c, calls) = parse_output("x <tool_call>\n{\"name\": \"n\", \"argu", PAR);
        assert_eq!(
            c.as_deref(),
            Some("x <tool_call>\n{\"name\": \"n\", \"argu")
        );
        assert!(calls.is_empty());
        // Arguments the model wrote as a string pass through.
        let (_, calls) = parse_output(
            "<tool_call>{\"name\": \"n\", \"arguments\": \"{\\\"a\\\":1}\"}</tool_call>",
            PAR,
        );
        assert_eq!(calls[0].arguments, "{\"a\":1}");
    }

    /// Streaming in every split gives what the whole text gives.
    #[test]
    fn streaming_matches_whole() {
        let texts = [
            "Sure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n",
            "no calls here <tool_ca but close\n\n",
            "<tool_call>bad</tool_call> after <tool_call>{\"name\": \"é\", \"arguments\": {\"k\": \"ü\"}}",
            "<tool_cal",
            "  \n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>  \n text \n",
            "日本<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>",
        ];
        for text in texts {
            let (want_c, want_calls) = parse_output(text, PAR);
            let chars: Vec<(usize, char)> = text.char_indices().collect();
            for step in 1..=4 {
                let mut p = HermesParser::new(PAR);
                let mut content = String::new();
                let mut calls = vec![];
                let bounds: Vec<usize> = chars
                    .iter()
                    .map(|&(i, _)| i)
                    .step_by(step)
                    .chain([text.len()])
                    .collect();
                for w in bounds.windows(2) {
                    let out = p.push(&text[w[0]..w[1]]);
                    // Nothing that could start a tag is passed on early.
                    assert!(!out.content.ends_with('<'), "{text:?} step {step}");
                    content.push_str(&out.content);
                    calls.extend(out.calls);
                }
                let out = p.finish();
                content.push_str(&out.content);
                calls.extend(out.calls);
                let strip = |v: &[ToolCall]| {
                    v.iter()
                        .map(|c| (c.index, c.name.clone(), c.arguments.clone()))
                        .collect::<Vec<_>>()
                };
                let got = (!content.is_empty()).then_some(content.clone());
                assert_eq!(got, want_c, "{text:?} step {step}");
                assert_eq!(strip(&calls), strip(&want_calls), "{text:?} step {step}");
            }
        }
    }

    #[test]
    fn grammars() {
        let r = req(add(), Some(json!("required")))
            .expect("ok")
            .expect("some");
        let g = grammar(&r).expect("grammar");
        assert!(
            g.starts_with("start: call (\"\\n\" call)*\ncall: call_0 | call_1\n"),
            "{g}"
        );
        assert!(g.contains(r#"call_0: "<tool_call>\n" %json {"type":"object","properties":{"name":{"const":"add"},"arguments":{"type":"object","properties":{"a":{"type":"integer"}}}}"#), "{g}");
        assert!(
            g.contains(r#"{"name":{"const":"now"},"arguments":{"type":"object"}}"#),
            "{g}"
        );
        let mut r1 = r.clone();
        r1.parallel = false;
        assert!(grammar(&r1).expect("g").starts_with("start: call\n"));
        let r = req(
            add(),
            Some(json!({"type": "function", "function": {"name": "now"}})),
        )
        .expect("ok")
        .expect("some");
        let g = grammar(&r).expect("grammar");
        assert!(g.starts_with("start: call\ncall: call_0\n"), "{g}");
        assert!(!g.contains("\"add\""), "{g}");
        let r = req(add(), None).expect("ok").expect("some");
        assert!(grammar(&r).is_none());
    }
}
