package model

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
)

// FuzzChatRequest feeds arbitrary bodies to the chat-completions parser and
// handler: they must never panic, must answer 200 exactly when the parser
// accepts the body, and an answer's token ids must spell its content and
// calls and match its usage.
func FuzzChatRequest(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}],"tools":[{"type":"function","function":{"name":"read_file"}}]}`,
		`{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a\"}"}}]},{"role":"tool","tool_call_id":"c","content":"ok"}],"tools":[{"type":"function","function":{"name":"run"}}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"messages":[{"role":"user","content":"\xff\xfe"}],"top_logprobs":5}`,
		`{"messages":[]}`,
		`{"messages":[{"role":"user","content":5}]}`,
		`{"messages":[{"role":"user"}],"tool_choice":"none","tools":[{"type":"function","function":{"name":"run"}}]}`,
		`[`,
		``,
	} {
		f.Add([]byte(seed))
	}
	s := New(Options{Seed: 1})
	f.Fuzz(func(t *testing.T, body []byte) {
		req, perr := ParseChatRequest(body)
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body)))
		if (perr == nil) != (rec.Code == http.StatusOK) {
			t.Fatalf("parser error %v but status %d: %s", perr, rec.Code, rec.Body.Bytes())
		}
		if perr != nil {
			var e APIError
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error.Message == "" {
				t.Fatalf("error body %q: %v", rec.Body.Bytes(), err)
			}
			return
		}
		g := s.generate(req.conversation(), requestKey(1, "chat", body))
		text, err := Detokenize(g.ids)
		if err != nil {
			t.Fatal(err)
		}
		want := g.content
		for _, c := range g.calls {
			want += "<tool_call>" + callHead(c.name) + c.args + "}</tool_call>"
		}
		if text != want || len(g.logprobs) != len(g.ids) {
			t.Fatalf("ids spell %q, want %q", text, want)
		}
		if _, err := Detokenize(g.promptIDs); err != nil {
			t.Fatal(err)
		}
		if req.Stream {
			return
		}
		var c ChatCompletion
		if err := json.Unmarshal(rec.Body.Bytes(), &c); err != nil {
			t.Fatalf("response %q: %v", rec.Body.Bytes(), err)
		}
		if c.Usage.PromptTokens != len(c.PromptTokenIDs) || c.Usage.CompletionTokens != len(c.Choices[0].TokenIDs) {
			t.Fatalf("usage %+v", c.Usage)
		}
	})
}
