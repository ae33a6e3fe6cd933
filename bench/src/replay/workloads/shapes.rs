//! Small synthetic workloads sized for a real CPU fleet (two cores, one thread per engine, a
//! model of 135M parameters prefilling a few hundred tokens a second), that run as well on the
//! simulator:
//! - `documents`: multi-turn document chat. Each conversation opens with its own document and
//!   a question, then asks follow-ups about it; the conversations run in phases, the first
//!   one at a time, the next several at once (`--phases 1,3`): a router must spread new
//!   documents over the fleet and bring each follow-up back to the document's server.
//! - `prefix_groups`: groups of users whose requests share a long system prompt, each user
//!   asking one short question, groups interleaved: the groups must be partitioned over the
//!   fleet, not all sent to the first holder of a prompt.
//! - `agentic`: an agent's loop. Every task shares one system prompt with the tools' manual,
//!   then grows by a short reply (the tool call) and a tool's output per step: long
//!   histories that differ only at their end, short outputs. By default the reply is text
//!   and the output a user message (what a small CPU model can serve); `--tool-calls` makes
//!   every reply a real tool call and every output its result, `--tool-tokens-max` varies the
//!   outputs' size, `--think-ms` waits between steps and `--store` chains stored Responses
//!   answers: the shape of Codex and Claude Code sessions (docs/results/agents.md).
//!
//! Text is words from a fixed list (`rng::filler`), about one token each for a real
//! tokenizer, derived from a seed alone, so every run sends the same bytes.

use crate::replay::record::{AgentTurn, ChatRequest, Message};
use crate::replay::rng::{filler, mix, Rng};

use super::sharegpt::{Conversation, Turn};

/// Bytes of filler per engine token: the words are short English ones (SmolLM2's tokenizer
/// reads the filler at about 6 bytes a token).
pub const BYTES_PER_TOKEN: u64 = 6;

fn text(seed: u64, tokens: u64) -> String {
    filler(seed, (tokens * BYTES_PER_TOKEN) as usize)
}

/// `documents`: the conversations of each phase, and how many of them run at once.
pub fn documents(
    documents: u32,
    document_tokens: u64,
    turns: u32,
    phases: &[u32],
    seed: u64,
) -> Vec<(Vec<Conversation>, u32)> {
    let questions = [
        "Summarize this document in a few sentences.",
        "Which places does it mention, and in what order?",
        "What happens in the last paragraph?",
        "List three words that appear most often.",
        "Is anything said twice? Quote it.",
    ];
    let convs: Vec<Conversation> = (0..documents as u64)
        .map(|d| {
            let doc = text(
                seed.wrapping_mul(1_000_003).wrapping_add(d),
                document_tokens,
            );
            let turns = (0..turns as usize)
                .map(|t| Turn {
                    text: match t {
                        0 => format!("Document {d}:\n{doc}\n\n{}", questions[0]),
                        t => questions[t % questions.len()].to_owned(),
                    },
                    output_length: 32,
                    ..Turn::default()
                })
                .collect();
            Conversation {
                session_id: format!("doc-{d}"),
                turns,
                model: None,
                system: Some("You are a careful reader. Answer from the document.".into()),
                agent: Default::default(),
                tenancy: Default::default(),
            }
        })
        .collect();
    split_phases(convs, phases)
}

/// Splits `convs` into `phases.len()` runs of as equal size as they go, each with its
/// concurrency.
fn split_phases(convs: Vec<Conversation>, phases: &[u32]) -> Vec<(Vec<Conversation>, u32)> {
    let n = phases.len().max(1);
    let per = convs.len().div_ceil(n);
    let mut rest = convs.into_iter();
    phases
        .iter()
        .map(|&c| (rest.by_ref().take(per).collect(), c.max(1)))
        .filter(|(p, _): &(Vec<Conversation>, u32)| !p.is_empty())
        .collect()
}

/// `prefix_groups`: `groups` system prompts of `system_tokens`, `users` questions of
/// `question_tokens` each, in an order that visits every group in turn. Oracle (bytes): a
/// group's prompt is cached after its first request.
pub fn prefix_groups(
    groups: u32,
    users: u32,
    system_tokens: u64,
    question_tokens: u64,
    seed: u64,
) -> Vec<ChatRequest> {
    let systems: Vec<String> = (0..groups as u64)
        .map(|g| {
            format!(
                "Group {g} instructions. {}",
                text(seed ^ 0x5eed_0000 ^ g, system_tokens)
            )
        })
        .collect();
    let mut out = Vec::new();
    for u in 0..users as u64 {
        for (g, system) in systems.iter().enumerate() {
            let question = format!(
                "User {u}: {}?",
                text(seed ^ ((g as u64) << 32) ^ u, question_tokens)
            );
            let total = (system.len() + question.len()) as f64;
            out.push(ChatRequest {
                messages: vec![
                    Message::new("system", system.clone()),
                    Message::new("user", question),
                ],
                max_tokens: 16,
                session: Some(format!("group-{g}-user-{u}")),
                model: None,
                step: None,
                turn: None,
                oracle_hit: if u == 0 { 0.0 } else { system.len() as f64 },
                oracle_total: total,
                agent: Default::default(),
                tenancy: Default::default(),
            });
        }
    }
    out
}

/// The `agentic` workload's shape.
#[derive(Debug, Clone)]
pub struct AgentShape {
    pub tasks: u32,
    pub steps: u32,
    /// Tokens of the system prompt (instructions and the tools' manual), shared by every task.
    pub system_tokens: u64,
    /// Tokens of a tool's output: the least and the most, log-uniform between (a file read or
    /// a test run is long, a grep short).
    pub tool_tokens: (u64, u64),
    /// Mean think time before each step after the first (uniform in 0.5-1.5x the mean).
    pub think_ms: u64,
    /// Replies are tool calls, and the tools' outputs their results.
    pub tool_calls: bool,
    /// Responses sessions chain stored answers with `previous_response_id`.
    pub store: bool,
    pub seed: u64,
}

/// `agentic`: `tasks` conversations of `steps` turns. The system prompt (instructions and
/// the tools' manual) is shared by every task; a task opens with its own description, and
/// each later turn is a tool's output.
pub fn agentic(shape: &AgentShape) -> Vec<Conversation> {
    let seed = shape.seed;
    let manual = format!(
        "You are a coding agent. Reply with one tool call per turn: read(path), grep(pattern), \
         edit(path, text) or run(command). Tools manual: {}",
        text(seed ^ 0xa9e7, shape.system_tokens)
    );
    let (least, most) = shape.tool_tokens;
    let agent = AgentTurn {
        tools: shape.tool_calls,
        store: shape.store,
        ..AgentTurn::default()
    };
    (0..shape.tasks as u64)
        .map(|t| {
            let mut rng = Rng::new(mix(seed ^ 0x7001 ^ (t << 24)));
            let turns = (0..shape.steps as u64)
                .map(|s| {
                    // Drawn for every step, so the sizes do not depend on the think time.
                    let (size, think) = (rng.next_f64(), rng.next_f64());
                    let tokens = log_uniform(least, most, size);
                    let text = match s {
                        0 => format!("Task {t}: {}", self::text(seed ^ (t << 20), least)),
                        s => format!(
                            "Tool output {s}:\n{}",
                            self::text(seed ^ (t << 20) ^ s, tokens)
                        ),
                    };
                    Turn {
                        text,
                        output_length: 24,
                        tool_result: s > 0,
                        think_ms: if s > 0 {
                            (shape.think_ms as f64 * (0.5 + think)) as u64
                        } else {
                            0
                        },
                    }
                })
                .collect();
            Conversation {
                session_id: format!("task-{t}"),
                turns,
                model: None,
                system: Some(manual.clone()),
                agent: agent.clone(),
                tenancy: Default::default(),
            }
        })
        .collect()
}

/// `least..=most`, log-uniform at `u` in [0, 1).
fn log_uniform(least: u64, most: u64, u: f64) -> u64 {
    if most <= least {
        return least;
    }
    let (a, b) = ((least.max(1) as f64).ln(), (most as f64).ln());
    ((a + (b - a) * u).exp().round() as u64).clamp(least, most)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::record::ToolCall;
    use crate::replay::workloads::sharegpt::Chat;

    #[test]
    fn documents_run_in_phases_and_follow_ups_extend_their_document() {
        let phases = documents(10, 800, 3, &[1, 3], 1);
        let sizes: Vec<(usize, u32)> = phases.iter().map(|(c, n)| (c.len(), *n)).collect();
        assert_eq!(sizes, [(5, 1), (5, 3)]);
        let conv = phases[1].0[0].clone();
        assert_eq!(conv.session_id, "doc-5");
        let mut chat = Chat::new(conv, 512);
        let first = chat.next_request().unwrap();
        assert_eq!(first.turn, Some(0));
        assert_eq!(first.messages[0].role, "system");
        let doc_bytes = first.messages[1].content.len() as u64;
        assert!((800 * BYTES_PER_TOKEN..800 * BYTES_PER_TOKEN + 100).contains(&doc_bytes));
        chat.record_reply("an answer".into());
        let second = chat.next_request().unwrap();
        assert_eq!(second.turn, Some(1));
        assert_eq!(second.messages[..2], first.messages[..]);
        assert!(second.oracle_hit / second.oracle_total > 0.9);
        // The same seed sends the same bytes; another seed other documents.
        let again = documents(10, 800, 3, &[1, 3], 1);
        assert_eq!(again[0].0[0].turns[0].text, phases[0].0[0].turns[0].text);
        let other = documents(10, 800, 3, &[1, 3], 2);
        assert_ne!(other[0].0[0].turns[0].text, phases[0].0[0].turns[0].text);
        // More phases than documents: no empty phase.
        assert_eq!(documents(2, 100, 1, &[1, 3, 4], 1).len(), 2);
    }

    #[test]
    fn prefix_groups_visit_every_group_in_turn_and_share_its_prompt() {
        let reqs = prefix_groups(4, 6, 600, 30, 1);
        assert_eq!(reqs.len(), 24);
        let system = |i: usize| reqs[i].messages[0].content.clone();
        assert_ne!(system(0), system(1));
        assert_eq!(system(0), system(4));
        assert_ne!(reqs[0].messages[1].content, reqs[4].messages[1].content);
        // The first request of a group misses; later ones hold its prompt.
        assert_eq!(reqs[2].oracle_hit, 0.0);
        assert_eq!(reqs[6].oracle_hit, system(6).len() as f64);
    }

    fn shape(tool_tokens: (u64, u64), think_ms: u64, tool_calls: bool) -> AgentShape {
        AgentShape {
            tasks: 4,
            steps: 6,
            system_tokens: 400,
            tool_tokens,
            think_ms,
            tool_calls,
            store: false,
            seed: 1,
        }
    }

    #[test]
    fn agent_tasks_share_the_manual_and_grow_by_tool_output() {
        let tasks = agentic(&shape((120, 120), 0, false));
        assert_eq!(tasks.len(), 4);
        assert_eq!(tasks[0].system, tasks[3].system);
        assert_eq!(tasks[0].turns.len(), 6);
        let mut chat = Chat::new(tasks[1].clone(), 512);
        let mut last = 0;
        while let Some(r) = chat.next_request() {
            let bytes: usize = r.messages.iter().map(|m| m.content.len()).sum();
            assert!(bytes > last, "each step's prompt extends the last");
            last = bytes;
            chat.record_reply("read(src/main.rs)".into());
        }
    }

    #[test]
    fn agent_loop_calls_tools_sizes_outputs_and_thinks() {
        let tasks = agentic(&shape((200, 4000), 2000, true));
        let outputs: Vec<&Turn> = tasks.iter().flat_map(|t| &t.turns[1..]).collect();
        assert!(outputs.iter().all(|t| t.tool_result));
        assert!(!tasks[0].turns[0].tool_result && tasks[0].turns[0].think_ms == 0);
        let bytes: Vec<u64> = outputs.iter().map(|t| t.text.len() as u64).collect();
        let tokens = |b: u64| b / BYTES_PER_TOKEN;
        assert!(
            bytes.iter().all(|&b| (200..=4010).contains(&tokens(b))),
            "{bytes:?}"
        );
        // Log-uniform: most outputs short, some long.
        assert!(bytes.iter().any(|&b| tokens(b) < 600) && bytes.iter().any(|&b| tokens(b) > 1500));
        assert!(outputs.iter().all(|t| (1000..3000).contains(&t.think_ms)));
        assert!(tasks[0].agent.tools && !tasks[0].agent.store);
        // The same seed, the same sizes; the default shape's bytes are unchanged by the options.
        let again = agentic(&shape((200, 4000), 0, false));
        assert_eq!(again[2].turns[3].text, tasks[2].turns[3].text);
        let fixed = agentic(&shape((120, 120), 0, false));
        assert!(fixed
            .iter()
            .flat_map(|t| &t.turns[1..])
            .all(|t| t.text.len() < 120 * 7));

        // The loop: a reply that is a call makes the next output its result.
        let mut chat = Chat::new(tasks[0].clone(), 512);
        let first = chat.next_request().unwrap();
        assert_eq!(first.messages.last().unwrap().role, "user");
        chat.record_answer(
            r#"{"command":"ls"}"#.into(),
            Some(ToolCall {
                id: "call_1".into(),
                name: "run".into(),
                arguments: r#"{"command":"ls"}"#.into(),
                item_id: None,
            }),
            None,
        );
        let second = chat.next_request().unwrap();
        let n = second.messages.len();
        assert_eq!(
            second.messages[n - 2].call.as_ref().unwrap().arguments,
            r#"{"command":"ls"}"#
        );
        assert_eq!(second.messages[n - 1].role, "tool");
        assert_eq!(second.messages[n - 1].call.as_ref().unwrap().id, "call_1");
        assert!(second.agent.think.as_millis() >= 1000 && second.agent.previous.is_none());
        // A text reply (chat) leaves the output a user message.
        chat.record_answer("read(a)".into(), None, None);
        assert_eq!(
            chat.next_request().unwrap().messages.last().unwrap().role,
            "user"
        );
    }

    #[test]
    fn stored_sessions_send_the_previous_id_and_what_follows_it() {
        let mut s = shape((100, 100), 0, true);
        s.store = true;
        let mut chat = Chat::new(agentic(&s).remove(0), 512);
        assert!(chat.next_request().unwrap().agent.previous.is_none());
        chat.record_answer(
            "{}".into(),
            Some(ToolCall {
                id: "c1".into(),
                name: "run".into(),
                arguments: "{}".into(),
                item_id: Some("fc_1".into()),
            }),
            Some("resp_1".into()),
        );
        let next = chat.next_request().unwrap();
        // system, task, call: held by resp_1; the output follows.
        assert_eq!(next.agent.previous, Some(("resp_1".to_owned(), 3)));
        assert_eq!(next.messages.len(), 4);
    }
}
