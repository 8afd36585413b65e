//! The tokenizer (`tokenizer.json` through the `tokenizers` crate), the special
//! tokens from `tokenizer_config.json`, and the chat template, rendered with
//! minijinja the way transformers renders it (trim_blocks, lstrip_blocks,
//! Python string methods, `raise_exception`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// Largest `tokenizer.json` accepted (real ones are tens of MB).
pub const MAX_TOKENIZER_BYTES: u64 = 512 << 20;

/// One chat message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Largest chat template file accepted (real ones are a few KB).
pub const MAX_CHAT_TEMPLATE_BYTES: u64 = 1 << 20;

/// A chat template read from a file (`--chat-template`), checked to compile.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    path: PathBuf,
    source: String,
}

impl ChatTemplate {
    /// Reads a Jinja file and compiles it (an error names the file and the
    /// template's syntax error).
    pub fn from_file(path: &Path) -> Result<Self> {
        let size = std::fs::metadata(path)
            .map_err(|e| Error::io(path, e))?
            .len();
        if size > MAX_CHAT_TEMPLATE_BYTES {
            return Err(Error::Tokenizer {
                path: path.to_path_buf(),
                message: format!(
                    "the chat template is {size} bytes, beyond the limit of {MAX_CHAT_TEMPLATE_BYTES}"
                ),
            });
        }
        let source = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_source(path, source)
    }

    /// A template from its text; `path` names it in errors.
    pub fn from_source(path: &Path, source: String) -> Result<Self> {
        let mut env = environment();
        env.add_template("chat", &source)
            .map_err(|e| Error::Tokenizer {
                path: path.to_path_buf(),
                message: format!("chat template does not compile: {e:#}"),
            })?;
        Ok(ChatTemplate {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The file it came from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The Jinja environment chat templates render in, as transformers sets it up.
fn environment<'a>() -> minijinja::Environment<'a> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", |_fmt: String| -> String { String::new() });
    env.add_filter("tojson", tojson_filter);
    env
}

/// Tokenizer plus chat template of a model folder.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    chat_template: Option<(PathBuf, String)>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and the chat template
    /// (`chat_template.jinja` if present, else the config's `chat_template`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(Error::MissingFile {
                path,
                what: "tokenizer",
            });
        }
        let size = std::fs::metadata(&path)
            .map_err(|e| Error::io(&path, e))?
            .len();
        if size > MAX_TOKENIZER_BYTES {
            return Err(Error::Tokenizer {
                path,
                message: format!(
                    "the file is {size} bytes, beyond the sane limit of {MAX_TOKENIZER_BYTES}"
                ),
            });
        }
        // A hostile file must not take the process down: a panic inside the
        // tokenizers crate becomes an error naming the file.
        let loaded = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(&path));
        let inner = match loaded {
            Ok(r) => r.map_err(|e| Error::Tokenizer {
                path: path.clone(),
                message: format!("cannot load tokenizer: {e}"),
            })?,
            Err(_) => {
                return Err(Error::Tokenizer {
                    path: path.clone(),
                    message: "cannot load tokenizer: the file is malformed (the parser panicked)"
                        .into(),
                });
            }
        };
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
            serde_json::from_str(&text).map_err(|e| Error::Json {
                path: cfg_path.clone(),
                message: e.to_string(),
            })?
        } else {
            Value::Null
        };
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.is_file() {
            let t = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            Some((jinja, t))
        } else {
            match cfg.get("chat_template") {
                Some(Value::String(s)) => Some((cfg_path.clone(), s.clone())),
                // A list of named templates: take "default".
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template").and_then(|s| s.as_str()))
                    .map(|s| (cfg_path.clone(), s.to_string())),
                _ => None,
            }
        };
        Ok(Tokenizer {
            inner,
            path,
            chat_template,
            bos_token: token_string(cfg.get("bos_token")),
            eos_token: token_string(cfg.get("eos_token")),
        })
    }

    fn err(&self, message: String) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            message,
        }
    }

    /// Encodes text; `add_special_tokens` applies the tokenizer's post-processor
    /// (e.g. a BOS token), as transformers does for plain prompts.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.err(format!("cannot encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.err(format!("cannot decode: {e}")))
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The `tokenizers` tokenizer itself.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The token string of an id (`convert_ids_to_tokens`), if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Replaces the model's chat template (`--chat-template`).
    pub fn set_chat_template(&mut self, t: ChatTemplate) {
        self.chat_template = Some((t.path, t.source));
    }

    /// Whether the model ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.render_chat(&msgs, None, add_generation_prompt)
    }

    /// Renders the chat template the way transformers' `apply_chat_template`
    /// does: `messages` as given (OpenAI-shaped maps: `role`, `content`, and
    /// `tool_calls` / `tool_call_id` / `name` where present) and `tools` as
    /// `[{"type": "function", "function": {...}}]`, or none. Maps keep their
    /// key order, and `tojson` writes Python's `json.dumps` format.
    pub fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let (tpath, source) = self
            .chat_template
            .as_ref()
            .ok_or_else(|| Error::Tokenizer {
                path: self.path.with_file_name("tokenizer_config.json"),
                message: "the model has no chat template".into(),
            })?;
        let terr = |e: minijinja::Error| Error::Tokenizer {
            path: tpath.clone(),
            message: format!("chat template: {e:#}"),
        };
        let mut env = environment();
        env.add_template("chat", source).map_err(terr)?;
        let tmpl = env.get_template("chat").map_err(terr)?;
        tmpl.render(minijinja::context! {
            messages => minijinja::Value::from_serialize(messages),
            tools => tools.map(minijinja::Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(terr)
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)` with those keyword
/// arguments (minijinja's own escapes HTML characters and writes compact
/// separators, which would change the prompt).
fn tojson_filter(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let bad = |m: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, m);
    let indent: Option<minijinja::Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match usize::try_from(v.clone()) {
            Ok(n) => Some(" ".repeat(n)),
            Err(_) => match v.as_str() {
                Some(s) => Some(s.to_string()),
                None => return Err(bad(format!("tojson: invalid indent {v}"))),
            },
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value).map_err(|e| bad(format!("tojson: {e}")))?;
    let (item, key) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => return Err(bad("tojson: separators must be two strings".into())),
        // Python's defaults: no spaces after ',' when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let opts = PyJson {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    opts.write(&v, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

/// Python's `json.dumps` output format.
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::to_string(s).unwrap_or_default();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }

    fn write(&self, v: &Value, depth: usize, out: &mut String) {
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => out.push_str(&n.to_string()),
            Value::String(s) => self.string(s, out),
            Value::Array(a) if a.is_empty() => out.push_str("[]"),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            Value::Object(m) if m.is_empty() => out.push_str("{}"),
            Value::Object(m) => {
                let mut entries: Vec<(&String, &Value)> = m.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }
}

/// `json.dumps(v, ensure_ascii=False)`: the format Hermes-style templates
/// and vLLM's tool parsers write JSON in (`", "` and `": "` separators, keys
/// in order, non-ASCII as is).
pub fn python_json(v: &Value) -> String {
    let opts = PyJson {
        indent: None,
        item: ", ".into(),
        key: ": ".into(),
        sort_keys: false,
        ensure_ascii: false,
    };
    let mut out = String::new();
    opts.write(v, 0, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
    }

    /// The qwen3 fixture's tokenizer with `tests/fixtures/tool_template`'s
    /// Hermes-style tool template.
    fn tool_tokenizer() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = fixtures().join("qwen3_moe_a/f32");
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).expect("copy");
        }
        std::fs::copy(
            fixtures().join("tool_template/chat_template.jinja"),
            dir.path().join("chat_template.jinja"),
        )
        .expect("copy template");
        let tok = Tokenizer::from_dir(dir.path()).expect("tokenizer");
        (dir, tok)
    }

    /// Tools, tool calls and tool results render exactly as transformers'
    /// apply_chat_template renders them (golden from
    /// tests/fixtures/tool_template/make_golden.py).
    #[test]
    fn tool_template_matches_transformers() {
        let (_dir, tok) = tool_tokenizer();
        let text = std::fs::read_to_string(fixtures().join("tool_template/render_golden.json"))
            .expect("golden");
        let golden: Value = serde_json::from_str(&text).expect("json");
        let cases = golden["cases"].as_array().expect("cases");
        assert!(cases.len() >= 4);
        for case in cases {
            let msgs = case["template_messages"].as_array().expect("messages");
            let tools = case["tools"].as_array().map(|v| v.as_slice());
            let got = tok.render_chat(msgs, tools, true).expect("render");
            assert_eq!(
                got,
                case["rendered"].as_str().expect("rendered"),
                "{}",
                case["name"]
            );
            let ids = tok.encode(&got, false).expect("encode");
            assert_eq!(Some(ids.len() as u64), case["prompt_tokens"].as_u64());
        }
    }

    #[test]
    fn python_json_format() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, {"x": null}], "a": "é\"<>&\n", "e": {}, "f": []}"#,
        )
        .expect("json");
        assert_eq!(
            python_json(&v),
            r#"{"b": [1, 2.5, {"x": null}], "a": "é\"<>&\n", "e": {}, "f": []}"#
        );
        // The tojson filter's keyword arguments, as Python's json.dumps.
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson_filter);
        let out = env
            .render_str(
                "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(sort_keys=true, separators=(',', ':')) }}|{{ 'é' | tojson(ensure_ascii=true) }}",
                minijinja::context! { v => minijinja::Value::from_serialize(serde_json::json!({"z": 1, "a": [true]})) },
            )
            .expect("render");
        assert_eq!(
            out,
            "{\"z\": 1, \"a\": [true]}|{\n  \"z\": 1,\n  \"a\": [\n    true\n  ]\n}|{\"a\":[true],\"z\":1}|\"\\u00e9\""
        );
    }

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/f32")
    }

    #[test]
    fn a_chat_template_file_replaces_the_models_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("t.jinja");
        std::fs::write(
            &good,
            "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        )
        .expect("write");
        let t = ChatTemplate::from_file(&good).expect("compiles");
        let mut tok = Tokenizer::from_dir(&fixture()).expect("fixture tokenizer");
        tok.set_chat_template(t);
        let msgs = [ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }];
        assert_eq!(
            tok.apply_chat_template(&msgs, true).ok().as_deref(),
            Some("<user>HI\n<assistant>")
        );

        let bad = dir.path().join("bad.jinja");
        std::fs::write(&bad, "{% for m in messages %}no end").expect("write");
        let e = ChatTemplate::from_file(&bad)
            .map(|_| ())
            .map_err(|e| e.to_string());
        assert!(
            e.as_ref()
                .is_err_and(|m| m.contains("bad.jinja") && m.contains("does not compile")),
            "{e:?}"
        );
        let missing = ChatTemplate::from_file(&dir.path().join("none.jinja"));
        assert!(missing.is_err_and(|e| e.to_string().contains("none.jinja")));
    }
}
