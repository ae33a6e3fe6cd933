//! The agent APIs' request profiles: an agent's turn n+1 extends turn n's blocks (prompt and
//! reply) whichever API it speaks, and what an agent moves between turns does not break them.

use super::*;
use serde_json::{json, Value};

const BLOCK: usize = 64;

fn of(endpoint: Endpoint, body: &Value) -> Result<RequestProfile, ApiError> {
    profile(
        endpoint,
        body.to_string().as_bytes(),
        SessionKeys::default(),
        BLOCK,
    )
}

fn tools() -> Value {
    json!([{"name":"read_file","description":"Reads a file. ".repeat(10),
            "input_schema":{"type":"object","properties":{"path":{"type":"string"}}}}])
}

fn messages_turn(history: &[Value]) -> Value {
    json!({"model":"claude","max_tokens":512,"stream":true,"tools":tools(),
           "system":[{"type":"text","text":"You are a coding agent. ".repeat(20)}],
           "messages":history})
}

/// Turn 1 asks; the agent calls a tool; turn 2 sends the tool's result; the model answers
/// in text; turn 3 asks again.
fn agent_history() -> Vec<Value> {
    vec![
        json!({"role":"user","content":"Fix the bug in main.rs, please. ".repeat(4)}),
        json!({"role":"assistant","content":[
            {"type":"thinking","thinking":"I should read the file first.","signature":"sig"},
            {"type":"text","text":"Let me look."},
            {"type":"tool_use","id":"toolu_1","name":"read_file","input":{"path":"src/main.rs"}}]}),
        json!({"role":"user","content":[
            {"type":"tool_result","tool_use_id":"toolu_1",
             "content":[{"type":"text","text":"fn main() { let x = 1; } ".repeat(10)}]}]}),
    ]
}

fn prefix_len(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn a_messages_turn_extends_the_last_one_with_its_text_reply() {
    let mut history = agent_history();
    let turn2 = messages_turn(&history);
    let p2 = of(Endpoint::Messages, &turn2).unwrap();
    assert_eq!(p2.endpoint, Endpoint::Messages);
    assert_eq!(p2.est_output_tokens, 512);
    assert!(p2.stream && p2.has_history);
    // The tool call and its result are the prompt's text, not a hash: a 300-byte result
    // makes several blocks.
    let without_result = of(Endpoint::Messages, &messages_turn(&history[..2])).unwrap();
    assert!(p2.prompt_bytes > without_result.prompt_bytes + 250);

    let reply = "The bug is the unused variable; here is the fix. ".repeat(4);
    let with_reply = p2.reply_blocks(&reply, &[]).unwrap();
    assert_eq!(
        with_reply,
        blocks_with_reply(
            Endpoint::Messages,
            turn2.to_string().as_bytes(),
            &reply,
            BLOCK
        )
        .unwrap()
    );
    history.push(json!({"role":"assistant","content":[{"type":"text","text":reply}]}));
    history.push(json!({"role":"user","content":"Now add a test."}));
    let p3 = of(Endpoint::Messages, &messages_turn(&history)).unwrap();
    // Every full block of turn 2's prompt and reply.
    assert_eq!(prefix_len(&with_reply, &p3.prefix_blocks), with_reply.len());
    assert!(with_reply.len() > p2.prefix_blocks.len());
    // The previous turn's prompt ends where its last reply starts.
    assert_eq!(p3.history_blocks, p2.prefix_blocks.len());
    assert_eq!(p2.session_key, p3.session_key);
    assert_eq!(p3.session_source, SessionSource::Content);
}

#[test]
fn messages_blocks_ignore_cache_control_and_see_tool_inputs() {
    let history = agent_history();
    let base = of(Endpoint::Messages, &messages_turn(&history)).unwrap();
    // Claude Code moves its cache breakpoint to the newest message every turn.
    let mut moved = history.clone();
    moved[2]["content"][0]["cache_control"] = json!({"type":"ephemeral"});
    let mut turn = messages_turn(&moved);
    turn["system"][0]["cache_control"] = json!({"type":"ephemeral"});
    let p = of(Endpoint::Messages, &turn).unwrap();
    assert_eq!(p.prefix_blocks, base.prefix_blocks);
    assert_eq!(p.session_key, base.session_key);

    let mut other = history.clone();
    other[1]["content"][2]["input"] = json!({"path":"src/lib.rs"});
    let p = of(Endpoint::Messages, &messages_turn(&other)).unwrap();
    let n = prefix_len(&p.prefix_blocks, &base.prefix_blocks);
    assert!(n > 0 && n < base.prefix_blocks.len());

    // A string system prompt is its one text block.
    let mut s = messages_turn(&history);
    s["system"] = json!("You are a coding agent. ".repeat(20));
    assert_eq!(
        of(Endpoint::Messages, &s).unwrap().prefix_blocks,
        base.prefix_blocks
    );
}

#[test]
fn messages_session_from_metadata_user_id_or_an_agent_header() {
    let mut body = messages_turn(&agent_history());
    body["metadata"] = json!({"user_id":"user_abc_account_x_session_42"});
    let p = of(Endpoint::Messages, &body).unwrap();
    assert_eq!(p.session_source, SessionSource::MetadataUserId);
    let mut h = http::HeaderMap::new();
    h.insert("x-claude-code-session-id", "s-1".parse().unwrap());
    let q = profile(
        Endpoint::Messages,
        body.to_string().as_bytes(),
        SessionKeys::default_order(Some(&h)),
        BLOCK,
    )
    .unwrap();
    assert_eq!(q.session_source, SessionSource::Header);
    assert_ne!(p.session_key, q.session_key);
}

#[test]
fn messages_errors_name_the_field() {
    let code = |b: Value| of(Endpoint::Messages, &b).unwrap_err().code;
    let ok = messages_turn(&agent_history());
    let mut no_max = ok.clone();
    no_max.as_object_mut().unwrap().remove("max_tokens");
    assert_eq!(code(no_max), "missing_max_tokens");
    let mut empty = ok.clone();
    empty["messages"] = json!([]);
    assert_eq!(code(empty), "invalid_messages");
    let mut no_model = ok.clone();
    no_model.as_object_mut().unwrap().remove("model");
    assert_eq!(code(no_model), "missing_model");
    let mut bad_block = ok.clone();
    bad_block["messages"][0]["content"] = json!([42]);
    assert_eq!(code(bad_block), "invalid_content");
    let mut bad_result = ok;
    bad_result["messages"][2]["content"][0]["content"] = json!(7);
    assert_eq!(code(bad_result), "invalid_content");
}

fn responses_turn(input: Value) -> Value {
    json!({"model":"gpt-oss","instructions":"You are Codex. ".repeat(30),"tools":[
        {"type":"function","name":"shell","parameters":{"type":"object"}}],
        "input":input,"stream":true,"store":false,"max_output_tokens":300})
}

#[test]
fn a_responses_turn_extends_the_last_one() {
    let first = vec![json!({"type":"message","role":"user",
        "content":[{"type":"input_text","text":"List the files and fix the build. ".repeat(3)}]})];
    let p1 = of(Endpoint::Responses, &responses_turn(json!(first))).unwrap();
    assert!(!p1.has_history);
    assert_eq!(p1.est_output_tokens, 300);
    // The model answers with reasoning and a tool call; the agent runs it and sends both
    // back with the output.
    let mut items = first.clone();
    items.push(json!({"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"gAAA"}));
    items.push(json!({"type":"function_call","call_id":"c1","name":"shell",
                      "arguments":"{\"cmd\":[\"ls\"]}"}));
    items.push(json!({"type":"function_call_output","call_id":"c1",
                      "output":"Cargo.toml\nsrc\n".repeat(10)}));
    let p2 = of(Endpoint::Responses, &responses_turn(json!(items))).unwrap();
    assert!(p2.has_history);
    assert_eq!(p2.history_blocks, p1.prefix_blocks.len());
    assert_eq!(
        prefix_len(&p1.prefix_blocks, &p2.prefix_blocks),
        p1.prefix_blocks.len()
    );
    assert_eq!(p1.session_key, p2.session_key);

    // A text answer, sent back as an assistant message, continues the stream as a chat's.
    let reply = "The build is fixed: the manifest lacked a dependency. ".repeat(3);
    let with_reply = p2.reply_blocks(&reply, &[]).unwrap();
    items.push(json!({"type":"message","role":"assistant",
                      "content":[{"type":"output_text","text":reply,"annotations":[]}]}));
    items.push(json!({"role":"user","content":"Thanks. Now run the tests."}));
    let p3 = of(Endpoint::Responses, &responses_turn(json!(items))).unwrap();
    assert_eq!(prefix_len(&with_reply, &p3.prefix_blocks), with_reply.len());
    assert_eq!(p3.history_blocks, p2.prefix_blocks.len());
}

#[test]
fn responses_input_forms_and_stored_chains() {
    let text = "Explain the borrow checker in one paragraph.";
    let as_string = of(Endpoint::Responses, &responses_turn(json!(text))).unwrap();
    let as_item = of(
        Endpoint::Responses,
        &responses_turn(json!([{"role":"user","content":text}])),
    )
    .unwrap();
    let as_part = of(
        Endpoint::Responses,
        &responses_turn(json!([{"role":"user","content":[{"type":"input_text","text":text}]}])),
    )
    .unwrap();
    assert_eq!(as_string.prefix_blocks, as_item.prefix_blocks);
    assert_eq!(as_string.prefix_blocks, as_part.prefix_blocks);
    assert_eq!(as_string.tail, as_part.tail);

    // A stored chain's next turn names the last response and carries only what is new.
    let mut next = responses_turn(json!("And the lifetimes?"));
    next["previous_response_id"] = json!("resp_abc");
    next["prompt_cache_key"] = json!("thread-7");
    let p = of(Endpoint::Responses, &next).unwrap();
    assert!(p.has_history);
    assert_eq!(p.session_source, SessionSource::PromptCacheKey);
}

#[test]
fn responses_errors_name_the_field() {
    let code = |b: Value| of(Endpoint::Responses, &b).unwrap_err().code;
    let mut none = responses_turn(json!("x"));
    none.as_object_mut().unwrap().remove("input");
    assert_eq!(code(none), "missing_input");
    assert_eq!(code(responses_turn(json!([]))), "invalid_input");
    assert_eq!(code(responses_turn(json!(5))), "invalid_input");
    assert_eq!(
        code(responses_turn(json!([{"content":"no type, no role"}]))),
        "invalid_input"
    );
    assert_eq!(
        code(responses_turn(
            json!([{"type":"function_call_output","output":{"bad":1}}])
        )),
        "invalid_content"
    );
}

/// A reply that is a tool call (with text before it, or alone): its blocks are those the next
/// turn starts with when it sends the call back, in each API's spelling, whatever spacing the
/// client writes a Messages tool input with.
#[test]
fn a_tool_call_reply_prefixes_the_next_turn() {
    let call = ReplyCall {
        name: "run".into(),
        arguments: r#"{"command":"cargo test","cwd":"."}"#.into(),
    };
    let output = "test result: ok. 12 passed; 0 failed ".repeat(6);

    let history = agent_history();
    let p = of(Endpoint::Messages, &messages_turn(&history)).unwrap();
    for text in ["", "Running the tests now."] {
        let with_call = p.reply_blocks(text, std::slice::from_ref(&call)).unwrap();
        assert!(with_call.len() > p.prefix_blocks.len());
        let mut blocks = vec![];
        if !text.is_empty() {
            blocks.push(json!({"type": "text", "text": text}));
        }
        // Python's spacing and another key order: the same call.
        blocks.push(json!({"type": "tool_use", "id": "toolu_2", "name": "run",
                           "input": {"cwd": ".", "command": "cargo test"}}));
        let mut next = history.clone();
        next.push(json!({"role": "assistant", "content": blocks}));
        next.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": output}]}));
        let mut body = messages_turn(&next).to_string();
        body = body.replace(r#""command":"cargo test""#, r#""command": "cargo test""#);
        let p2 = profile(
            Endpoint::Messages,
            body.as_bytes(),
            SessionKeys::default(),
            BLOCK,
        )
        .unwrap();
        assert_eq!(
            prefix_len(&with_call, &p2.prefix_blocks),
            with_call.len(),
            "{text:?}"
        );
    }

    let input = json!([{"role": "user", "content": "Fix the failing test. ".repeat(10)}]);
    let p = of(Endpoint::Responses, &responses_turn(input.clone())).unwrap();
    for text in ["", "Running the tests now."] {
        let with_call = p.reply_blocks(text, std::slice::from_ref(&call)).unwrap();
        let mut items = input.as_array().unwrap().clone();
        if !text.is_empty() {
            items.push(
                json!({"type": "message", "role": "assistant", "id": "msg_1",
                              "content": [{"type": "output_text", "text": text}]}),
            );
        }
        items.push(
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1",
                          "name": "run", "arguments": call.arguments, "status": "completed"}),
        );
        items.push(json!({"type": "function_call_output", "call_id": "call_1", "output": output}));
        let p2 = of(Endpoint::Responses, &responses_turn(json!(items))).unwrap();
        assert_eq!(
            prefix_len(&with_call, &p2.prefix_blocks),
            with_call.len(),
            "{text:?}"
        );
    }
}
