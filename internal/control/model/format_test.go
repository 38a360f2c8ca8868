package model_test

import (
	"encoding/json"
	"testing"

	"stasis/internal/control/model"
	"stasis/internal/ssecheck"
)

// The scripted model's own streams keep the OpenAI streaming formats, and
// a client accumulating them gets the non-streamed object, for every turn
// of the default script (tool calls, text beside calls, a final answer).
func TestStreamsKeepTheFormats(t *testing.T) {
	ts := newServer(t, model.Options{Seed: 5})
	// Chat Completions.
	msgs := userMessages()
	for turn := range 5 {
		for _, usage := range []bool{true, false} {
			req := chatRequest(msgs, miniTools, true)
			if !usage {
				delete(req, "stream_options")
			}
			_, _, stream := post(t, ts.URL+"/v1/chat/completions", req)
			if err := ssecheck.CheckChat(stream, usage); err != nil {
				t.Fatalf("chat turn %d usage=%v: %v\n%s", turn, usage, err, stream)
			}
			got, err := ssecheck.AccumulateChat(stream)
			if err != nil {
				t.Fatal(err)
			}
			_, _, plain := post(t, ts.URL+"/v1/chat/completions", chatRequest(msgs, miniTools, false))
			if err := ssecheck.SameChat(sampled(t, got), sampled(t, plain), usage); err != nil {
				t.Errorf("chat turn %d usage=%v: %v", turn, usage, err)
			}
		}
		_, _, plain := post(t, ts.URL+"/v1/chat/completions", chatRequest(msgs, miniTools, false))
		c := completion(t, plain)
		calls := c.Choices[0].Message.ToolCalls
		if len(calls) == 0 {
			break
		}
		msgs = append(msgs, map[string]any{"role": "assistant", "content": c.Choices[0].Message.Content, "tool_calls": calls})
		for _, tc := range calls {
			msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": tc.ID, "content": "ok"})
		}
	}
	// Responses.
	respTools := []map[string]any{{"type": "function", "name": "read_file"}, {"type": "function", "name": "run"}, {"type": "function", "name": "write_file"}}
	input := []any{map[string]any{"role": "user", "content": "fix it"}}
	for turn := range 5 {
		req := map[string]any{"model": "m", "input": input, "tools": respTools}
		_, _, plain := post(t, ts.URL+"/v1/responses", req)
		req["stream"] = true
		_, _, stream := post(t, ts.URL+"/v1/responses", req)
		if err := ssecheck.CheckResponses(stream); err != nil {
			t.Fatalf("responses turn %d: %v\n%s", turn, err, stream)
		}
		got, err := ssecheck.AccumulateResponses(stream)
		if err != nil {
			t.Fatal(err)
		}
		if !ssecheck.Equal(sampled(t, got), sampled(t, plain)) {
			t.Errorf("responses turn %d: accumulated\n%s\nwant\n%s", turn, got, plain)
		}
		var r struct {
			Output []map[string]any `json:"output"`
		}
		_ = json.Unmarshal(plain, &r)
		more := false
		for _, it := range r.Output {
			input = append(input, it)
			if it["type"] == "function_call" {
				more = true
				input = append(input, map[string]any{"type": "function_call_output", "call_id": it["call_id"], "output": "ok"})
			}
		}
		if !more {
			break
		}
	}
}

// sampled drops what the scripted model derives from the request body
// (which "stream" changes: logprob values and ids) and the chunks'
// token_ids (each chunk carries its own, so an SDK keeps the last;
// TestStreamMatchesNonStream checks their concatenation).
func sampled(t *testing.T, b []byte) []byte {
	t.Helper()
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	var strip func(any)
	strip = func(v any) {
		switch x := v.(type) {
		case map[string]any:
			for _, k := range []string{"logprobs", "id", "call_id", "token_ids"} {
				delete(x, k)
			}
			for _, y := range x {
				strip(y)
			}
		case []any:
			for _, y := range x {
				strip(y)
			}
		}
	}
	strip(v)
	out, _ := json.Marshal(v)
	return out
}
