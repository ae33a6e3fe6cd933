//! A stored Responses conversation: each response's input and output items, sharing the
//! turns before it.

use std::sync::Arc;

use serde_json::Value;

/// A conversation up to and including one response. The responses that continue it share it
/// rather than copy it, so a long agent loop stores each item once.
#[derive(Debug)]
pub struct Thread {
    pub prior: Option<Arc<Thread>>,
    /// This request's input items (normalised, each with an id).
    pub input: Vec<Value>,
    /// The response's output items.
    pub output: Vec<Value>,
}

impl Thread {
    /// The threads from the first to this one. Iterative: a conversation may run to
    /// thousands of turns.
    fn chain(&self) -> Vec<&Thread> {
        let mut out = vec![self];
        let mut at = self;
        while let Some(p) = at.prior.as_deref() {
            out.push(p);
            at = p;
        }
        out.reverse();
        out
    }

    /// Every item of the conversation, inputs and outputs in turn order.
    pub fn items(&self) -> Vec<&Value> {
        self.chain()
            .into_iter()
            .flat_map(|t| t.input.iter().chain(&t.output))
            .collect()
    }

    /// The input items of this thread's response: everything before its output.
    pub fn input_items(&self) -> Vec<&Value> {
        let mut items = self.prior.as_deref().map_or_else(Vec::new, Thread::items);
        items.extend(&self.input);
        items
    }
}

/// What a Responses answer needs beyond the chat request: the conversation to store.
#[derive(Debug, Clone)]
pub struct ResponsesInput {
    pub prior: Option<Arc<Thread>>,
    pub input: Vec<Value>,
    /// OpenAI's default is to store.
    pub store: bool,
}
