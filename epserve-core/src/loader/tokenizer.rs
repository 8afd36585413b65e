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
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(terr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
