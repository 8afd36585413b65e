//! Streaming detokenization: turns a growing list of generated token ids into
//! text deltas that are safe to send (no half UTF-8 characters, spacing as the
//! full decode gives it), and cuts the text at the first stop string, holding
//! back the tail that could still become one.

use crate::error::Result;
use crate::loader::tokenizer::Tokenizer;

/// How many prompt tokens give the first generated token its spacing context.
const CONTEXT_TOKENS: usize = 5;

/// One step's outcome.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TextDelta {
    /// New text to emit (may be empty).
    pub text: String,
    /// A stop string was found; generation must end.
    pub stopped: bool,
}

/// Incremental detokenizer with stop strings.
#[derive(Debug, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    text: String,
    emitted: usize,
    stops: Vec<String>,
    max_stop: usize,
    stopped: bool,
}

impl TextStream {
    /// Starts a stream after `prompt` (its last tokens give spacing context).
    pub fn new(prompt: &[u32], stops: &[String]) -> Self {
        let ctx = &prompt[prompt.len().saturating_sub(CONTEXT_TOKENS)..];
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_stop = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        TextStream {
            ids: ctx.to_vec(),
            prefix_offset: 0,
            read_offset: ctx.len(),
            text: String::new(),
            emitted: 0,
            stops,
            max_stop,
            stopped: false,
        }
    }

    /// Adds one generated token; returns what can be emitted now.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<TextDelta> {
        if self.stopped {
            return Ok(TextDelta {
                text: String::new(),
                stopped: true,
            });
        }
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let start = floor_char_boundary(&full, prefix.len());
            self.text.push_str(&full[start..]);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
        Ok(self.release(false))
    }

    /// Flushes everything held back (end of generation), including bytes of
    /// an unfinished character, so the text equals the full decode.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<TextDelta> {
        if !self.stopped && self.read_offset < self.ids.len() {
            let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
            let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
            let start = floor_char_boundary(&full, prefix.len());
            self.text.push_str(&full[start..]);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
        Ok(self.release(true))
    }

    /// All text so far (cut at a stop string if one was hit).
    pub fn text(&self) -> &str {
        &self.text
    }

    fn release(&mut self, all: bool) -> TextDelta {
        if !self.stops.is_empty() && !self.stopped {
            let from = floor_char_boundary(&self.text, self.emitted.saturating_sub(self.max_stop));
            let hit = self
                .stops
                .iter()
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
                .min();
            if let Some(at) = hit {
                self.text.truncate(at);
                self.stopped = true;
            }
        }
        let end = if all || self.stopped || self.stops.is_empty() {
            self.text.len()
        } else {
            // Hold back what could be the start of a stop string.
            floor_char_boundary(
                &self.text,
                self.text.len().saturating_sub(self.max_stop - 1),
            )
        };
        let end = end.max(self.emitted);
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        TextDelta {
            text: out,
            stopped: self.stopped,
        }
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
