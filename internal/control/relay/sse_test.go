package relay

import (
	"encoding/json"
	"strings"
	"testing"

	"stasis/internal/ssecheck"
)

// Chat completions the relay re-chunks: each shape a harness sees.
var chatCases = map[string]string{
	"text": `{"id":"c1","object":"chat.completion","created":7,"model":"m","system_fingerprint":"fp1","prompt_token_ids":[1,2],
"choices":[{"index":0,"message":{"role":"assistant","content":"hello there","refusal":null},"logprobs":{"content":[{"token":"h","logprob":-0.5,"bytes":[104],"top_logprobs":[]}]},"finish_reason":"stop","token_ids":[5,6]}],
"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}`,
	"tools": `{"id":"c2","object":"chat.completion","created":7,"model":"m",
"choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"t1","type":"function","function":{"name":"read","arguments":"{\"path\":\"a\"}"}}]},"finish_reason":"tool_calls","logprobs":null}],
"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}`,
	"text+tools": completion,
	"many tools": `{"id":"c3","object":"chat.completion","created":7,"model":"m","service_tier":"default",
"choices":[{"index":0,"message":{"role":"assistant","content":"two calls","tool_calls":[{"id":"t1","type":"function","function":{"name":"read","arguments":"{}"}},{"id":"t2","type":"function","function":{"name":"run","arguments":"{\"cmd\":\"ls\"}"}},{"id":"t3","type":"function","function":{"name":"noargs","arguments":""}}]},"finish_reason":"tool_calls"}],
"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}`,
	"refusal": `{"id":"c4","object":"chat.completion","created":7,"model":"m",
"choices":[{"index":0,"message":{"role":"assistant","content":null,"refusal":"I can't help with that."},"finish_reason":"stop"}],
"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}`,
	"reasoning_content": `{"id":"c5","object":"chat.completion","created":7,"model":"m",
"choices":[{"index":0,"message":{"role":"assistant","content":"42","reasoning_content":"think"},"finish_reason":"stop"}],
"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}`,
	"n=2": `{"id":"c6","object":"chat.completion","created":7,"model":"m",
"choices":[{"index":0,"message":{"role":"assistant","content":"one"},"finish_reason":"stop"},{"index":1,"message":{"role":"assistant","content":"other","tool_calls":[{"id":"t9","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],
"usage":{"prompt_tokens":2,"completion_tokens":4,"total_tokens":6}}`,
	"empty content": `{"id":"c7","object":"chat.completion","created":7,"model":"m",
"choices":[{"index":0,"message":{"role":"assistant","content":""},"finish_reason":"length"}]}`,
}

func TestChatChunksFormat(t *testing.T) {
	for name, c := range chatCases {
		for _, usage := range []bool{false, true} {
			out, err := ChatChunks([]byte(c), usage)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if err := ssecheck.CheckChat(out, usage); err != nil {
				t.Fatalf("%s usage=%v: %v\n%s", name, usage, err, out)
			}
			got, err := ssecheck.AccumulateChat(out)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			wantUsage := usage && strings.Contains(c, `"usage"`)
			if err := ssecheck.SameChat(got, []byte(c), wantUsage); err != nil {
				t.Errorf("%s usage=%v: %v", name, usage, err)
			}
		}
	}
}

func TestChatChunksShape(t *testing.T) {
	out, err := ChatChunks([]byte(chatCases["text"]), true)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ssecheck.Parse(out)
	if err != nil {
		t.Fatal(err)
	}
	var chunks []map[string]any
	for _, ev := range s.Events {
		var m map[string]any
		_ = json.Unmarshal(ev.Data, &m)
		chunks = append(chunks, m)
	}
	if len(chunks) != 4 || !s.Done {
		t.Fatalf("%d chunks:\n%s", len(chunks), out)
	}
	first := chunks[0]["choices"].([]any)[0].(map[string]any)
	if mustJSON(first["delta"]) != `{"content":"","refusal":null,"role":"assistant"}` || mustJSON(chunks[0]["prompt_token_ids"]) != "[1,2]" {
		t.Errorf("first chunk %s", mustJSON(chunks[0]))
	}
	body := chunks[1]["choices"].([]any)[0].(map[string]any)
	if mustJSON(body["token_ids"]) != "[5,6]" || body["logprobs"] == nil || mustJSON(body["delta"]) != `{"content":"hello there"}` {
		t.Errorf("content chunk %s", mustJSON(chunks[1]))
	}
	for i, c := range chunks {
		if c["system_fingerprint"] != "fp1" || c["id"] != "c1" {
			t.Errorf("chunk %d lacks the completion's id or fingerprint: %s", i, mustJSON(c))
		}
		if _, ok := c["usage"]; !ok {
			t.Errorf("chunk %d has no usage member", i)
		}
	}
	if last := chunks[3]; mustJSON(last["choices"]) != "[]" || last["usage"] == nil {
		t.Errorf("usage chunk %s", mustJSON(last))
	}
}

func TestChatChunksRefusesWhatItCannotStream(t *testing.T) {
	for _, c := range []string{
		`{"id":"x","created":1,"model":"m"}`,
		`{"id":"x","created":1,"model":"m","choices":[{"message":{"content":5}}]}`,
		`{"id":"x","created":1,"model":"m","choices":[{"message":{"tool_calls":[{"type":"function","function":{"name":"f"}}]}}]}`,
		`{"id":"x","created":1,"model":"m","choices":[{"index":3,"message":{}}]}`,
		`{"created":1,"model":"m","choices":[]}`,
	} {
		if out, err := ChatChunks([]byte(c), false); err == nil {
			t.Errorf("ChatChunks(%s) = %s", c, out)
		}
	}
}

const responseText = `{"id":"resp_1","object":"response","created_at":7,"status":"completed","model":"m","output":[
{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"hello there","annotations":[],"logprobs":[{"token":"h","logprob":-0.5,"bytes":[104],"top_logprobs":[]}]}]}],
"parallel_tool_calls":true,"tool_choice":"auto","tools":[],"error":null,"incomplete_details":null,
"usage":{"input_tokens":3,"output_tokens":2,"total_tokens":5},"prompt_token_ids":[1,2,3],"token_ids":[9,8]}`

// Responses the relay re-streams: each shape a harness sees.
var responsesCases = map[string]string{
	"text": responseText,
	"tool": `{"id":"resp_2","object":"response","status":"completed","model":"m","output":[
{"type":"function_call","id":"fc_1","call_id":"call_1","name":"read","arguments":"{\"path\":\"a\"}","status":"completed"}],
"usage":{"input_tokens":3,"output_tokens":2,"total_tokens":5}}`,
	"text+tools": `{"id":"resp_3","object":"response","status":"completed","model":"m","output":[
{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"two calls","annotations":[]}]},
{"type":"function_call","id":"fc_1","call_id":"call_1","name":"read","arguments":"{}","status":"completed"},
{"type":"function_call","id":"fc_2","call_id":"call_2","name":"run","arguments":"{\"cmd\":\"ls\"}","status":"completed"},
{"type":"function_call","id":"fc_3","call_id":"call_3","name":"none","arguments":"","status":"completed"}],
"usage":{"input_tokens":3,"output_tokens":2,"total_tokens":5}}`,
	"reasoning": `{"id":"resp_4","object":"response","status":"completed","model":"m","output":[
{"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"first"},{"type":"summary_text","text":"second"}],"content":[{"type":"reasoning_text","text":"because"}],"encrypted_content":null},
{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"done","annotations":[{"type":"url_citation","url":"u","title":"t","start_index":0,"end_index":4}]}]}],
"usage":{"input_tokens":3,"output_tokens":2,"total_tokens":5}}`,
	"refusal": `{"id":"resp_5","object":"response","status":"completed","model":"m","output":[
{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"refusal","refusal":"I can't help with that."}]}],"usage":null}`,
	"custom and other": `{"id":"resp_6","object":"response","status":"completed","model":"m","output":[
{"type":"custom_tool_call","id":"ctc_1","call_id":"call_1","name":"apply_patch","input":"*** Begin Patch"},
{"type":"web_search_call","id":"ws_1","status":"completed","action":{"type":"search","query":"q"}}]}`,
	"incomplete": `{"id":"resp_7","object":"response","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"model":"m","output":[
{"type":"message","id":"msg_1","status":"incomplete","role":"assistant","content":[{"type":"output_text","text":"cut sho","annotations":[]}]}],
"usage":{"input_tokens":3,"output_tokens":2,"total_tokens":5}}`,
	"failed": `{"id":"resp_8","object":"response","status":"failed","error":{"code":"server_error","message":"boom"},"model":"m","output":[]}`,
}

func TestResponsesEventsFormat(t *testing.T) {
	for name, c := range responsesCases {
		out, err := ResponsesEvents([]byte(c))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := ssecheck.CheckResponses(out); err != nil {
			t.Fatalf("%s: %v\n%s", name, err, out)
		}
		got, err := ssecheck.AccumulateResponses(out)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !ssecheck.Equal(got, []byte(c)) {
			t.Errorf("%s: accumulated\n%s\nwant\n%s", name, got, c)
		}
	}
}

// The defect the openai SDK showed: the added item held the whole text and
// a delta repeated it, so the SDK's snapshot doubled the text.
func TestResponsesEventsNoDoubledText(t *testing.T) {
	out, err := ResponsesEvents([]byte(responseText))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(out), "hello there"); n != 5 {
		t.Errorf("the text appears %d times, want 5 (delta, text done, part done, item done, completed):\n%s", n, out)
	}
	s, _ := ssecheck.Parse(out)
	var types []string
	for _, ev := range s.Events {
		types = append(types, ev.Name)
	}
	want := "response.created response.in_progress response.output_item.added response.content_part.added response.output_text.delta response.output_text.done response.content_part.done response.output_item.done response.completed"
	if strings.Join(types, " ") != want {
		t.Errorf("events %s\nwant %s", strings.Join(types, " "), want)
	}
	var created struct {
		Response map[string]any `json:"response"`
	}
	_ = json.Unmarshal(s.Events[0].Data, &created)
	if created.Response["usage"] != nil || created.Response["status"] != "in_progress" {
		t.Errorf("response.created carries %s", s.Events[0].Data)
	}
}

func TestResponsesEventsRefusesWhatItCannotStream(t *testing.T) {
	for _, c := range []string{
		`[]`, `{"status":"in_progress","output":[]}`, `{"output":[{"type":"message","content":[]}]}`,
		`{"output":[{"type":"function_call","id":"f","name":"n","arguments":{}}]}`, `{"output":{}}`,
	} {
		if out, err := ResponsesEvents([]byte(c)); err == nil {
			t.Errorf("ResponsesEvents(%s) = %s", c, out)
		}
	}
}

func TestStreamErrors(t *testing.T) {
	body := []byte(`{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded","param":null}}`)
	ev := ChatStreamError(429, body)
	if err := ssecheck.CheckChat(ev, false); err != nil {
		t.Fatalf("%v\n%s", err, ev)
	}
	if _, err := ssecheck.AccumulateChat(ev); err == nil || !strings.Contains(err.Error(), "Rate limit reached") {
		t.Errorf("accumulate: %v", err)
	}
	want := `data: {"error":{"code":"rate_limit_exceeded","message":"Rate limit reached","param":null,"type":"requests"}}` + "\n\n"
	if string(ev) != want {
		t.Errorf("chat error event %q\nwant %q", ev, want)
	}
	plain := ChatStreamError(502, []byte("bad gateway"))
	if !strings.Contains(string(plain), `"code":"502"`) || !strings.Contains(string(plain), `upstream answered 502: bad gateway`) || !strings.Contains(string(plain), `"type":"server_error"`) {
		t.Errorf("chat error from a plain body: %s", plain)
	}
	// After the stream's first events: the error continues their numbering.
	prefix, _ := ResponsesEvents([]byte(responsesCases["failed"]))
	s, _ := ssecheck.Parse(prefix)
	cut := []byte(strings.Join(strings.SplitAfter(string(prefix), "\n\n")[:2], ""))
	rev := ResponsesStreamError(500, []byte(`{"error":{"message":"boom","type":"server_error","code":null}}`), 2)
	if err := ssecheck.CheckResponses(append(cut, rev...)); err != nil || len(s.Events) < 2 {
		t.Fatalf("%v\n%s%s", err, cut, rev)
	}
	if err := ssecheck.CheckResponses(rev); err == nil {
		t.Error("an error event numbered 2 passes as the first event")
	}
	if got := string(ResponsesStreamError(500, nil, 0)); got != "event: error\ndata: {\"code\":\"500\",\"message\":\"upstream answered 500\",\"param\":null,\"sequence_number\":0,\"type\":\"error\"}\n\n" {
		t.Errorf("responses error event %q", got)
	}
}

func FuzzResponsesEvents(f *testing.F) {
	for _, c := range responsesCases {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		out, err := ResponsesEvents(b)
		if err != nil {
			return
		}
		if err := ssecheck.CheckResponses(out); err != nil {
			t.Fatalf("ResponsesEvents(%s) breaks the format: %v\n%s", b, err, out)
		}
	})
}
