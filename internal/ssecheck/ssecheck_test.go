package ssecheck

import (
	"strings"
	"testing"
)

// chatOK is a well-formed chat stream: role, content, a tool call opened
// and continued, the finish chunk, usage, [DONE].
var chatOK = strings.Join([]string{
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}`,
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}],"usage":null}`,
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t1","type":"function","function":{"name":"f","arguments":""}}]},"finish_reason":null}],"usage":null}`,
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]},"finish_reason":null}],"usage":null}`,
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"usage":null}`,
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`,
	`data: [DONE]`,
}, "\n\n") + "\n\n"

// TestCheckChatFails: the checker passes the well-formed stream and
// fails each broken one.
func TestCheckChatFails(t *testing.T) {
	if err := CheckChat([]byte(chatOK), true); err != nil {
		t.Fatalf("a good stream: %v", err)
	}
	acc, err := AccumulateChat([]byte(chatOK))
	if err != nil || !strings.Contains(string(acc), `"content":"Hi"`) || !strings.Contains(string(acc), `"arguments":"{}"`) {
		t.Fatalf("accumulated: %s %v", acc, err)
	}
	for name, mutate := range map[string]func(string) string{
		"no [DONE]":           func(s string) string { return strings.Replace(s, "data: [DONE]\n\n", "", 1) },
		"usage not asked":     func(s string) string { return s }, // checked with includeUsage false below
		"no role first":       func(s string) string { return strings.Replace(s, `"role":"assistant",`, "", 1) },
		"call without its id": func(s string) string { return strings.Replace(s, `"id":"t1",`, "", 1) },
		"another id midway": func(s string) string {
			return strings.Replace(s, `{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"}`, `{"id":"c2","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"}`, 1)
		},
		"no finish": func(s string) string {
			return strings.Replace(s, `"finish_reason":"tool_calls"`, `"finish_reason":null`, 1)
		},
		"a chunk after [DONE]": func(s string) string { return s + "data: {}\n\n" },
	} {
		usage := name != "usage not asked"
		if err := CheckChat([]byte(mutate(chatOK)), usage); err == nil {
			t.Errorf("%s: passed", name)
		}
	}
}

var responsesOK = strings.Join([]string{
	"event: response.created\ndata: " + `{"type":"response.created","sequence_number":0,"response":{"id":"r1","object":"response","status":"in_progress","output":[],"usage":null}}`,
	"event: response.in_progress\ndata: " + `{"type":"response.in_progress","sequence_number":1,"response":{"id":"r1","object":"response","status":"in_progress","output":[],"usage":null}}`,
	"event: response.output_item.added\ndata: " + `{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"message","id":"m1","status":"in_progress","role":"assistant","content":[]}}`,
	"event: response.content_part.added\ndata: " + `{"type":"response.content_part.added","sequence_number":3,"item_id":"m1","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]}}`,
	"event: response.output_text.delta\ndata: " + `{"type":"response.output_text.delta","sequence_number":4,"item_id":"m1","output_index":0,"content_index":0,"delta":"Hi","logprobs":[]}`,
	"event: response.output_text.done\ndata: " + `{"type":"response.output_text.done","sequence_number":5,"item_id":"m1","output_index":0,"content_index":0,"text":"Hi","logprobs":[]}`,
	"event: response.content_part.done\ndata: " + `{"type":"response.content_part.done","sequence_number":6,"item_id":"m1","output_index":0,"content_index":0,"part":{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}}`,
	"event: response.output_item.done\ndata: " + `{"type":"response.output_item.done","sequence_number":7,"output_index":0,"item":{"type":"message","id":"m1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}]}}`,
	"event: response.completed\ndata: " + `{"type":"response.completed","sequence_number":8,"response":{"id":"r1","object":"response","status":"completed","output":[{"type":"message","id":"m1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}]}],"usage":{"input_tokens":1,"output_tokens":1,"total_tokens":2}}}`,
}, "\n\n") + "\n\n"

// TestCheckResponsesFails: the well-formed Responses stream passes; the
// relay's old defects and other breaks fail.
func TestCheckResponsesFails(t *testing.T) {
	if err := CheckResponses([]byte(responsesOK)); err != nil {
		t.Fatalf("a good stream: %v", err)
	}
	acc, err := AccumulateResponses([]byte(responsesOK))
	if err != nil || !strings.Contains(string(acc), `"text":"Hi"`) {
		t.Fatalf("accumulated: %s %v", acc, err)
	}
	for name, mutate := range map[string]func(string) string{
		// The relay's old defect: the item added finished, with its text.
		"added item finished": func(s string) string {
			return strings.Replace(s, `"item":{"type":"message","id":"m1","status":"in_progress","role":"assistant","content":[]}`,
				`"item":{"type":"message","id":"m1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}]}`, 1)
		},
		"sequence skips":    func(s string) string { return strings.Replace(s, `"sequence_number":5`, `"sequence_number":6`, 1) },
		"delta is not done": func(s string) string { return strings.Replace(s, `"delta":"Hi"`, `"delta":"Ho"`, 1) },
		"no created":        func(s string) string { return s[strings.Index(s, "\n\n")+2:] },
		"usage at the start": func(s string) string {
			return strings.Replace(s, `"output":[],"usage":null}}`, `"output":[],"usage":{"total_tokens":2}}}`, 1)
		},
		"no completed at end": func(s string) string { return s[:strings.LastIndex(strings.TrimSuffix(s, "\n\n"), "\n\n")+2] },
	} {
		if err := CheckResponses([]byte(mutate(responsesOK))); err == nil {
			t.Errorf("%s: passed", name)
		}
	}
}
