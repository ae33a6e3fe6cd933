//! Multi-turn chat from ShareGPT (`{"session_id", "turns": [{"text", "output_length"}]}`).
//!
//! Closed loop: each turn carries the whole history, including the replies actually received,
//! so a router that keeps a conversation on one backend finds its earlier turns cached.
//!
//! Oracle: the share of a turn's prompt that one infinite cache would hold, one that keeps the
//! generated tokens as vLLM does: the longest common prefix of this turn's prompt with the
//! previous turn's prompt followed by its reply, counted in bytes (~tokens), so that the run's
//! rate weights each turn by its size.

use std::path::Path;

use serde::Deserialize;

use super::read_jsonl;
use crate::replay::record::{AgentTurn, ChatRequest, Message, Tenancy, ToolCall};

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Turn {
    pub text: String,
    pub output_length: u64,
    /// The text is the output of the tool the previous reply called (`agentic`): sent as the
    /// call's result when the reply was a call, as a user message otherwise.
    #[serde(default)]
    pub tool_result: bool,
    /// Milliseconds to wait before sending this turn (think time).
    #[serde(default)]
    pub think_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Conversation {
    pub session_id: String,
    pub turns: Vec<Turn>,
    /// The model every turn names (`multi_model`); None sends `--model`.
    #[serde(skip)]
    pub model: Option<String>,
    /// A system message before the first turn (the synthetic shapes; ShareGPT has none).
    #[serde(skip)]
    pub system: Option<String>,
    /// An agent session's options (`agentic`): tools, stored answers.
    #[serde(skip)]
    pub agent: AgentTurn,
    /// Optional `tenant`, `priority` and `slo_ttft_ms` fields, sent with every turn.
    #[serde(flatten)]
    pub tenancy: Tenancy,
}

pub fn load(path: &Path) -> Result<Vec<Conversation>, String> {
    let convs: Vec<Conversation> = read_jsonl(path)?;
    let convs: Vec<Conversation> = convs.into_iter().filter(|c| !c.turns.is_empty()).collect();
    if convs.is_empty() {
        return Err(format!("{}: no conversation has a turn", path.display()));
    }
    Ok(convs)
}

/// One conversation in progress.
pub struct Chat {
    conv: Conversation,
    next_turn: usize,
    history: Vec<Message>,
    /// What the ideal cache holds of this conversation, as rendered for oracle accounting:
    /// the previous turn's prompt, then its reply once received.
    prev_stream: String,
    max_tokens_cap: u32,
    /// The last answer's id when it was stored, and the history's length after it.
    stored: Option<(String, usize)>,
}

impl Chat {
    pub fn new(conv: Conversation, max_tokens_cap: u32) -> Self {
        let history = conv
            .system
            .iter()
            .map(|s| Message::new("system", s.clone()))
            .collect();
        Self {
            conv,
            next_turn: 0,
            history,
            prev_stream: String::new(),
            max_tokens_cap,
            stored: None,
        }
    }

    /// The next turn's request, or `None` when the conversation is over.
    pub fn next_request(&mut self) -> Option<ChatRequest> {
        let turn = self.conv.turns.get(self.next_turn)?;
        self.next_turn += 1;
        let call = match self.history.last() {
            Some(m) if turn.tool_result && m.role == "assistant" => m.call.clone(),
            _ => None,
        };
        let message = match call {
            Some(call) => Message {
                call: Some(call),
                ..Message::new("tool", turn.text.clone())
            },
            None => Message::new("user", turn.text.clone()),
        };
        self.history.push(message);
        let rendered = render(&self.history);
        let hit = common_prefix(&self.prev_stream, &rendered) as f64;
        let total = rendered.len() as f64;
        self.prev_stream = rendered;
        Some(ChatRequest {
            messages: self.history.clone(),
            max_tokens: turn.output_length.clamp(1, self.max_tokens_cap as u64) as u32,
            session: Some(self.conv.session_id.clone()),
            model: self.conv.model.clone(),
            step: None,
            turn: Some(self.next_turn as u32 - 1),
            oracle_hit: hit,
            oracle_total: total,
            agent: AgentTurn {
                previous: self.stored.clone().filter(|_| self.conv.agent.store),
                think: std::time::Duration::from_millis(turn.think_ms),
                ..self.conv.agent.clone()
            },
            tenancy: self.conv.tenancy.clone(),
        })
    }

    /// Appends the reply received for the last turn, as a chat client would. The server
    /// computed the reply's KV after the prompt's, so the ideal cache holds it too.
    #[cfg(test)]
    pub fn record_reply(&mut self, text: String) {
        self.record_answer(text, None, None);
    }

    /// Appends the reply received: `text`, or the tool call `call` (whose arguments `text`
    /// is), and the answer's id when the server stored it.
    pub fn record_answer(&mut self, text: String, call: Option<ToolCall>, stored: Option<String>) {
        let reply = match call {
            Some(call) => Message {
                call: Some(call),
                ..Message::new("assistant", "")
            },
            None => Message::new("assistant", text),
        };
        render_message(&reply, &mut self.prev_stream);
        self.history.push(reply);
        self.stored = stored.map(|id| (id, self.history.len()));
    }
}

/// A stand-in for the chat template: only prefix equality matters for the oracle.
fn render(history: &[Message]) -> String {
    let mut s = String::new();
    for m in history {
        render_message(m, &mut s);
    }
    s
}

fn render_message(m: &Message, out: &mut String) {
    out.push_str(&m.role);
    out.push('\n');
    out.push_str(&m.content);
    out.push('\n');
    if let Some(c) = m.call.as_ref().filter(|_| m.role == "assistant") {
        out.push_str(&c.name);
        out.push_str(&c.arguments);
        out.push('\n');
    }
}

fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv() -> Conversation {
        Conversation {
            session_id: "s1".into(),
            turns: vec![
                Turn {
                    text: "hello there".into(),
                    output_length: 9000,
                    ..Turn::default()
                },
                Turn {
                    text: "and then?".into(),
                    output_length: 3,
                    ..Turn::default()
                },
            ],
            model: None,
            system: None,
            agent: Default::default(),
            tenancy: Tenancy::default(),
        }
    }

    #[test]
    fn a_conversations_tenancy_goes_with_every_turn() {
        let p = std::env::temp_dir().join(format!("kvbench-conv-{}.jsonl", std::process::id()));
        std::fs::write(
            &p,
            "{\"session_id\": \"s\", \"tenant\": \"gold\", \"priority\": 1, \"turns\": [\
             {\"text\": \"a\", \"output_length\": 1}, {\"text\": \"b\", \"output_length\": 1}]}\n",
        )
        .unwrap();
        let convs = load(&p).unwrap();
        std::fs::remove_file(&p).ok();
        let mut chat = Chat::new(convs[0].clone(), 8);
        let first = chat.next_request().unwrap();
        chat.record_reply("x".into());
        let second = chat.next_request().unwrap();
        let gold = Tenancy {
            tenant: Some("gold".into()),
            priority: Some(1),
            slo_ttft_ms: None,
        };
        assert_eq!((first.tenancy, second.tenancy), (gold.clone(), gold));
    }

    #[test]
    fn history_carries_replies_and_turns() {
        let mut c = Chat::new(conv(), 512);
        let r1 = c.next_request().unwrap();
        assert_eq!(r1.messages, vec![Message::new("user", "hello there")]);
        assert_eq!(r1.max_tokens, 512);
        assert_eq!(r1.session.as_deref(), Some("s1"));
        assert_eq!(r1.oracle_hit, 0.0);
        c.record_reply(" tok0 tok1".into());
        let r2 = c.next_request().unwrap();
        assert_eq!(
            r2.messages,
            vec![
                Message::new("user", "hello there"),
                Message::new("assistant", " tok0 tok1"),
                Message::new("user", "and then?"),
            ]
        );
        assert_eq!(r2.max_tokens, 3);
        // The whole first prompt repeats, and so does the reply that followed it; only the new
        // user turn is not in the ideal cache.
        let new_turn = "user\nand then?\n".len() as f64;
        assert_eq!(r2.oracle_hit, r2.oracle_total - new_turn);
        assert!(r2.oracle_hit > r1.oracle_total + " tok0 tok1".len() as f64);
        assert!(c.next_request().is_none());
    }
}
