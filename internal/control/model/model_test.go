package model_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/model"
)

// The structs below follow the OpenAI field names, independently of the
// package's own types, so that the tests check the wire shape.

type oaToolCall struct {
	Index    *int   `json:"index"`
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type oaLogprob struct {
	Token       string  `json:"token"`
	Logprob     float64 `json:"logprob"`
	Bytes       []int   `json:"bytes"`
	TopLogprobs []struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
	} `json:"top_logprobs"`
}

type oaUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type oaCompletion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int `json:"index"`
		Message struct {
			Role      string       `json:"role"`
			Content   *string      `json:"content"`
			ToolCalls []oaToolCall `json:"tool_calls"`
		} `json:"message"`
		Logprobs struct {
			Content []oaLogprob `json:"content"`
		} `json:"logprobs"`
		FinishReason string  `json:"finish_reason"`
		TokenIDs     []int64 `json:"token_ids"`
	} `json:"choices"`
	Usage          *oaUsage `json:"usage"`
	PromptTokenIDs []int64  `json:"prompt_token_ids"`
}

type oaChunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index int `json:"index"`
		Delta struct {
			Role      string       `json:"role"`
			Content   *string      `json:"content"`
			ToolCalls []oaToolCall `json:"tool_calls"`
		} `json:"delta"`
		Logprobs *struct {
			Content []oaLogprob `json:"content"`
		} `json:"logprobs"`
		FinishReason *string `json:"finish_reason"`
		TokenIDs     []int64 `json:"token_ids"`
	} `json:"choices"`
	Usage          *oaUsage `json:"usage"`
	PromptTokenIDs []int64  `json:"prompt_token_ids"`
}

type oaError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

// Tool sets of the two harnesses.
var (
	miniTools     = []string{"read_file", "write_file", "edit_file", "run"}
	opencodeTools = []string{"read", "edit", "write", "bash"}
)

func tools(names ...string) []map[string]any {
	var out []map[string]any
	for _, n := range names {
		out = append(out, map[string]any{"type": "function", "function": map[string]any{
			"name": n, "description": "the " + n + " tool", "parameters": map[string]any{"type": "object"},
		}})
	}
	return out
}

func newServer(t *testing.T, o model.Options) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(model.New(o))
	t.Cleanup(ts.Close)
	return ts
}

// post sends a JSON body and returns the status, headers and body.
func post(t *testing.T, url string, body any, header ...string) (int, http.Header, []byte) {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case []byte:
		b = v
	case string:
		b = []byte(v)
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	return resp.StatusCode, resp.Header, out
}

func chatRequest(messages []map[string]any, toolNames []string, stream bool) map[string]any {
	r := map[string]any{"model": "policy-7b", "messages": messages}
	if toolNames != nil {
		r["tools"] = tools(toolNames...)
	}
	if stream {
		r["stream"] = true
		r["stream_options"] = map[string]any{"include_usage": true}
	}
	return r
}

func userMessages() []map[string]any {
	return []map[string]any{
		{"role": "system", "content": "You are a coding agent."},
		{"role": "user", "content": "Fix the failing test. ✓"},
	}
}

func detok(t *testing.T, ids []int64) string {
	t.Helper()
	s, err := model.Detokenize(ids)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func completion(t *testing.T, body []byte) *oaCompletion {
	t.Helper()
	var c oaCompletion
	d := json.NewDecoder(bytes.NewReader(body))
	if err := d.Decode(&c); err != nil {
		t.Fatalf("not a chat completion: %v\n%s", err, body)
	}
	if len(c.Choices) != 1 {
		t.Fatalf("%d choices: %s", len(c.Choices), body)
	}
	return &c
}

// checkTokens checks that the ids, logprobs and usage agree with the text.
func checkTokens(t *testing.T, c *oaCompletion, wantText string) {
	t.Helper()
	ch := c.Choices[0]
	if got := detok(t, ch.TokenIDs); got != wantText {
		t.Errorf("token_ids detokenize to %q, want %q", got, wantText)
	}
	if len(ch.Logprobs.Content) != len(ch.TokenIDs) {
		t.Errorf("%d logprob entries for %d tokens", len(ch.Logprobs.Content), len(ch.TokenIDs))
	}
	var fromBytes []byte
	for i, e := range ch.Logprobs.Content {
		if !(e.Logprob < 0) {
			t.Errorf("logprob %d is %v, want negative", i, e.Logprob)
		}
		fromBytes = append(fromBytes, intsToBytes(e.Bytes)...)
	}
	if string(fromBytes) != wantText {
		t.Errorf("logprob bytes spell %q, want %q", fromBytes, wantText)
	}
	if c.Usage == nil || c.Usage.PromptTokens != len(c.PromptTokenIDs) || c.Usage.CompletionTokens != len(ch.TokenIDs) ||
		c.Usage.TotalTokens != c.Usage.PromptTokens+c.Usage.CompletionTokens {
		t.Errorf("usage %+v does not match %d prompt and %d completion ids", c.Usage, len(c.PromptTokenIDs), len(ch.TokenIDs))
	}
}

func intsToBytes(xs []int) []byte {
	b := make([]byte, len(xs))
	for i, x := range xs {
		b[i] = byte(x)
	}
	return b
}

func callText(name, args string) string {
	return `<tool_call>{"name":"` + name + `","arguments":` + args + `}</tool_call>`
}

func TestChatToolCallTurnHasOpenAIShapeAndTokens(t *testing.T) {
	ts := newServer(t, model.Options{Seed: 7})
	code, hdr, body := post(t, ts.URL+"/v1/chat/completions", chatRequest(userMessages(), miniTools, false))
	if code != 200 || !strings.HasPrefix(hdr.Get("Content-Type"), "application/json") {
		t.Fatalf("status %d %s: %s", code, hdr.Get("Content-Type"), body)
	}
	c := completion(t, body)
	if !strings.HasPrefix(c.ID, "chatcmpl-") || c.Object != "chat.completion" || c.Model != "policy-7b" || c.Created == 0 {
		t.Errorf("envelope: %+v", c)
	}
	ch := c.Choices[0]
	if ch.FinishReason != "tool_calls" || ch.Message.Role != "assistant" || ch.Message.Content != nil || len(ch.Message.ToolCalls) != 1 {
		t.Fatalf("choice: %s", body)
	}
	call := ch.Message.ToolCalls[0]
	var args map[string]string
	if call.Type != "function" || !strings.HasPrefix(call.ID, "call_") || call.Function.Name != "read_file" ||
		json.Unmarshal([]byte(call.Function.Arguments), &args) != nil || args["path"] != "README.md" {
		t.Errorf("tool call %+v", call)
	}
	checkTokens(t, c, callText("read_file", `{"path":"README.md"}`))
	prompt := detok(t, c.PromptTokenIDs)
	if !strings.HasPrefix(prompt, "<|bos|>") || !strings.Contains(prompt, "<|im_start|>user\nFix the failing test. ✓<|im_end|>") ||
		!strings.HasSuffix(prompt, "<|im_start|>assistant\n") || !strings.Contains(prompt, `"name":"run"`) {
		t.Errorf("prompt: %q", prompt)
	}
}

// converse plays a whole conversation the way a harness does: append the
// assistant message and a tool result per call, until a text answer.
func converse(t *testing.T, url string, toolNames []string, stream bool) (calls []string, answer string) {
	t.Helper()
	msgs := userMessages()
	var lastIDs []int64
	for turn := 0; turn < 10; turn++ {
		var (
			content   *string
			toolCalls []oaToolCall
			prompt    []int64
			ids       []int64
		)
		if stream {
			s := readStream(t, url, chatRequest(msgs, toolNames, true))
			if !s.done {
				t.Fatal("stream without [DONE]")
			}
			content, toolCalls, prompt, ids = &s.content, s.calls, s.prompt, s.ids
		} else {
			code, _, body := post(t, url+"/v1/chat/completions", chatRequest(msgs, toolNames, false))
			if code != 200 {
				t.Fatalf("turn %d: status %d: %s", turn, code, body)
			}
			c := completion(t, body)
			content, toolCalls = c.Choices[0].Message.Content, c.Choices[0].Message.ToolCalls
			prompt, ids = c.PromptTokenIDs, c.Choices[0].TokenIDs
		}
		// The prompt holds the tokens generated at the previous turn.
		if lastIDs != nil && !bytes.Contains([]byte(detok(t, prompt)), []byte(detok(t, lastIDs))) {
			t.Errorf("turn %d: the prompt does not hold the previous turn's tokens", turn)
		}
		lastIDs = ids
		if len(toolCalls) == 0 {
			if content == nil {
				t.Fatalf("turn %d: neither content nor tool calls", turn)
			}
			return calls, *content
		}
		am := map[string]any{"role": "assistant", "content": nil, "tool_calls": toolCalls}
		if content != nil && *content != "" {
			am["content"] = *content
		}
		msgs = append(msgs, am)
		for _, tc := range toolCalls {
			calls = append(calls, tc.Function.Name+" "+tc.Function.Arguments)
			msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": tc.ID, "content": "result of " + tc.Function.Name})
		}
	}
	t.Fatal("no final answer after 10 turns")
	return nil, ""
}

func TestDefaultScriptConversationInOrder(t *testing.T) {
	ts := newServer(t, model.Options{Seed: 1})
	calls, answer := converse(t, ts.URL, miniTools, false)
	want := []string{`read_file {"path":"README.md"}`, `run {"command":"ls"}`}
	if fmt.Sprint(calls) != fmt.Sprint(want) || !strings.Contains(answer, "Done") {
		t.Errorf("mini tools: calls %q, answer %q", calls, answer)
	}
	calls, answer = converse(t, ts.URL, opencodeTools, true)
	want = []string{`read {"filePath":"README.md"}`, `bash {"command":"ls","description":"List the files in the work tree"}`}
	if fmt.Sprint(calls) != fmt.Sprint(want) || !strings.Contains(answer, "Done") {
		t.Errorf("OpenCode tools, streamed: calls %q, answer %q", calls, answer)
	}
}

func TestCustomScriptConversation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "script.json")
	script := `{"name": "fix", "turns": [
	  {"content": "Looking.", "tool_calls": [
	    {"name": "read_file", "arguments": {"path": "a.go"}},
	    {"name": "read_file", "arguments": "{\"path\": \"b.go\"}"}]},
	  {"tool_calls": [{"name": "write_file", "arguments": {"path": "a.go", "content": "package a\n"}}]},
	  {"content": "Fixed a.go — done."}
	]}`
	if err := os.WriteFile(path, []byte(script), 0o644); err != nil {
		t.Fatal(err)
	}
	s, err := model.LoadScript(path)
	if err != nil {
		t.Fatal(err)
	}
	ts := newServer(t, model.Options{Script: s})
	for _, stream := range []bool{false, true} {
		calls, answer := converse(t, ts.URL, miniTools, stream)
		want := []string{`read_file {"path":"a.go"}`, `read_file {"path":"b.go"}`, `write_file {"path":"a.go","content":"package a\n"}`}
		if fmt.Sprint(calls) != fmt.Sprint(want) || answer != "Fixed a.go — done." {
			t.Errorf("stream=%v: calls %q, answer %q", stream, calls, answer)
		}
	}
	// Past the end, the last answer again.
	msgs := userMessages()
	for range 4 {
		msgs = append(msgs, map[string]any{"role": "assistant", "content": "x"}, map[string]any{"role": "user", "content": "more"})
	}
	_, _, body := post(t, ts.URL+"/v1/chat/completions", chatRequest(msgs, miniTools, false))
	if c := completion(t, body); c.Choices[0].Message.Content == nil || *c.Choices[0].Message.Content != "Fixed a.go — done." {
		t.Errorf("past the end: %s", body)
	}
}

func TestToolTurnWithoutMatchingToolsAnswersInText(t *testing.T) {
	ts := newServer(t, model.Options{})
	for _, tc := range []struct {
		tools []string
		says  string
	}{
		{nil, "offers no tools"},
		{[]string{"search", "browse"}, "the request's tools are: search, browse"},
	} {
		code, _, body := post(t, ts.URL+"/v1/chat/completions", chatRequest(userMessages(), tc.tools, false))
		c := completion(t, body)
		ch := c.Choices[0]
		if code != 200 || len(ch.Message.ToolCalls) != 0 || ch.FinishReason != "stop" || ch.Message.Content == nil ||
			!strings.Contains(*ch.Message.Content, "read_file or read") || !strings.Contains(*ch.Message.Content, tc.says) {
			t.Errorf("tools %v: %s", tc.tools, body)
			continue
		}
		checkTokens(t, c, *ch.Message.Content)
	}
	// tool_choice "none" withdraws the tools.
	req := chatRequest(userMessages(), miniTools, false)
	req["tool_choice"] = "none"
	_, _, body := post(t, ts.URL+"/v1/chat/completions", req)
	if c := completion(t, body); len(c.Choices[0].Message.ToolCalls) != 0 {
		t.Errorf("tool_choice none: %s", body)
	}
}

type streamResult struct {
	chunks  []oaChunk
	content string
	calls   []oaToolCall
	ids     []int64
	prompt  []int64
	lps     []oaLogprob
	usage   *oaUsage
	finish  string
	done    bool
	err     error // reading the stream
}

// readStream posts a streaming request and parses the SSE reply.
func readStream(t *testing.T, url string, body any, header ...string) *streamResult {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(b))
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("stream: status %d, %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	r := &streamResult{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("not an SSE data line: %q", line)
		}
		if r.done {
			t.Fatalf("data after [DONE]: %q", line)
		}
		if data == "[DONE]" {
			r.done = true
			continue
		}
		var c oaChunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("chunk: %v: %s", err, data)
		}
		if c.Object != "chat.completion.chunk" || !strings.HasPrefix(c.ID, "chatcmpl-") {
			t.Fatalf("chunk envelope: %s", data)
		}
		r.chunks = append(r.chunks, c)
		if c.PromptTokenIDs != nil {
			r.prompt = c.PromptTokenIDs
		}
		if c.Usage != nil {
			if len(c.Choices) != 0 {
				t.Errorf("the usage chunk has choices: %s", data)
			}
			r.usage = c.Usage
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil {
				r.content += *ch.Delta.Content
			}
			for _, tc := range ch.Delta.ToolCalls {
				if tc.Index == nil {
					t.Fatalf("tool call delta without index: %s", data)
				}
				if *tc.Index == len(r.calls) {
					r.calls = append(r.calls, tc)
				} else {
					r.calls[*tc.Index].Function.Arguments += tc.Function.Arguments
				}
			}
			r.ids = append(r.ids, ch.TokenIDs...)
			if ch.Logprobs != nil {
				r.lps = append(r.lps, ch.Logprobs.Content...)
			}
			if ch.FinishReason != nil {
				r.finish = *ch.FinishReason
			}
		}
	}
	r.err = sc.Err()
	return r
}

func TestStreamMatchesNonStream(t *testing.T) {
	ts := newServer(t, model.Options{Seed: 3})
	msgs := userMessages()
	for turn := range 3 {
		_, _, body := post(t, ts.URL+"/v1/chat/completions", chatRequest(msgs, miniTools, false))
		c := completion(t, body)
		s := readStream(t, ts.URL, chatRequest(msgs, miniTools, true))
		if s.err != nil || !s.done {
			t.Fatalf("turn %d: stream ended with %v, done=%v", turn, s.err, s.done)
		}
		ch := c.Choices[0]
		if fmt.Sprint(s.ids) != fmt.Sprint(ch.TokenIDs) || fmt.Sprint(s.prompt) != fmt.Sprint(c.PromptTokenIDs) {
			t.Errorf("turn %d: streamed ids differ from the non-streamed ones", turn)
		}
		if len(s.lps) != len(s.ids) || s.finish != ch.FinishReason {
			t.Errorf("turn %d: %d logprobs for %d ids, finish %q", turn, len(s.lps), len(s.ids), s.finish)
		}
		if s.usage == nil || *s.usage != *c.Usage {
			t.Errorf("turn %d: usage %+v, want %+v", turn, s.usage, c.Usage)
		}
		if s.chunks[0].Choices[0].Delta.Role != "assistant" {
			t.Errorf("the first chunk does not set the role")
		}
		if len(ch.Message.ToolCalls) > 0 {
			if len(s.calls) != len(ch.Message.ToolCalls) || s.calls[0].Function.Name != ch.Message.ToolCalls[0].Function.Name ||
				s.calls[0].Function.Arguments != ch.Message.ToolCalls[0].Function.Arguments || !strings.HasPrefix(s.calls[0].ID, "call_") {
				t.Errorf("turn %d: streamed calls %+v, want %+v", turn, s.calls, ch.Message.ToolCalls)
			}
			msgs = append(msgs, map[string]any{"role": "assistant", "tool_calls": ch.Message.ToolCalls})
			msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": ch.Message.ToolCalls[0].ID, "content": "ok"})
		} else if s.content != *ch.Message.Content || detok(t, s.ids) != s.content {
			t.Errorf("turn %d: streamed content %q, want %q", turn, s.content, *ch.Message.Content)
		}
	}
	// Without include_usage there is no usage chunk.
	req := chatRequest(msgs, miniTools, true)
	delete(req, "stream_options")
	if s := readStream(t, ts.URL, req); s.usage != nil || !s.done {
		t.Errorf("usage without include_usage: %+v", s.usage)
	}
}

func rawPost(t *testing.T, url string, body []byte) []byte {
	t.Helper()
	code, _, out := post(t, url, body)
	if code != 200 {
		t.Fatalf("status %d: %s", code, out)
	}
	return out
}

func TestDeterministicForASeed(t *testing.T) {
	a := newServer(t, model.Options{Seed: 42})
	b := newServer(t, model.Options{Seed: 42})
	c := newServer(t, model.Options{Seed: 43})
	for _, stream := range []bool{false, true} {
		body, _ := json.Marshal(chatRequest(userMessages(), miniTools, stream))
		ra := rawPost(t, a.URL+"/v1/chat/completions", body)
		if rb := rawPost(t, b.URL+"/v1/chat/completions", body); !bytes.Equal(ra, rb) {
			t.Errorf("stream=%v: two servers with seed 42 differ:\n%s\n%s", stream, ra, rb)
		}
		if again := rawPost(t, a.URL+"/v1/chat/completions", body); !bytes.Equal(ra, again) {
			t.Errorf("stream=%v: the same server answered differently", stream)
		}
		if rc := rawPost(t, c.URL+"/v1/chat/completions", body); bytes.Equal(ra, rc) {
			t.Errorf("stream=%v: seeds 42 and 43 gave the same bytes", stream)
		}
	}
	body, _ := json.Marshal(map[string]any{"input": "hi", "tools": []any{}})
	if ra, rb := rawPost(t, a.URL+"/v1/responses", body), rawPost(t, b.URL+"/v1/responses", body); !bytes.Equal(ra, rb) {
		t.Error("responses differ for the same seed")
	}
}

func TestTopLogprobs(t *testing.T) {
	ts := newServer(t, model.Options{})
	req := chatRequest(userMessages(), nil, false)
	req["logprobs"], req["top_logprobs"] = true, 3
	_, _, body := post(t, ts.URL+"/v1/chat/completions", req)
	c := completion(t, body)
	for i, e := range c.Choices[0].Logprobs.Content {
		if len(e.TopLogprobs) != 3 || e.TopLogprobs[0].Token != e.Token || e.TopLogprobs[0].Logprob != e.Logprob ||
			!(e.TopLogprobs[1].Logprob < e.TopLogprobs[0].Logprob) || e.TopLogprobs[1].Token == e.Token {
			t.Fatalf("entry %d: %+v", i, e)
		}
	}
}

func TestFaultsByHeader(t *testing.T) {
	ts := newServer(t, model.Options{})
	url := ts.URL + "/v1/chat/completions"
	req := chatRequest(userMessages(), miniTools, false)

	code, hdr, body := post(t, url, req, model.FaultHeader, "429")
	var e oaError
	if code != 429 || hdr.Get("Retry-After") == "" || json.Unmarshal(body, &e) != nil || e.Error.Message == "" || e.Error.Type == "" || e.Error.Code == "" {
		t.Errorf("429: status %d, Retry-After %q, %s", code, hdr.Get("Retry-After"), body)
	}
	code, _, body = post(t, url, req, model.FaultHeader, "500")
	if code != 500 || json.Unmarshal(body, &e) != nil || e.Error.Type != "server_error" {
		t.Errorf("500: status %d, %s", code, body)
	}
	code, _, body = post(t, url, req, model.FaultHeader, "explode")
	if code != 400 || !strings.Contains(string(body), "429, 500, drop or none") {
		t.Errorf("bad fault header: status %d, %s", code, body)
	}

	// drop, streamed: some chunks, then the connection closes without [DONE].
	s := readStream(t, ts.URL, chatRequest(userMessages(), miniTools, true), model.FaultHeader, "drop")
	if s.done || len(s.chunks) == 0 || !errors.Is(s.err, io.ErrUnexpectedEOF) {
		t.Errorf("drop: done=%v, %d chunks, err %v", s.done, len(s.chunks), s.err)
	}
	// drop, not streamed: no response at all.
	b, _ := json.Marshal(req)
	hreq, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	hreq.Header.Set(model.FaultHeader, "drop")
	if resp, err := http.DefaultClient.Do(hreq); err == nil {
		resp.Body.Close()
		t.Errorf("drop without stream: got status %d", resp.StatusCode)
	}
	// The server is still fine, and the metrics counted it all.
	if code, _, body := post(t, url, req); code != 200 {
		t.Errorf("after the faults: %d %s", code, body)
	}
	want := []string{
		`stasis_model_faults_injected_total{kind="429"} 1`,
		`stasis_model_faults_injected_total{kind="500"} 1`,
		`stasis_model_faults_injected_total{kind="drop"} 2`,
		`stasis_model_requests_total{endpoint="chat_completions",code="dropped"} 2`,
		`stasis_model_requests_total{endpoint="chat_completions",code="429"} 1`,
	}
	// A dropped request is counted when its handler returns, which can be
	// just after the client has seen the connection close: poll.
	var m string
	for deadline := time.Now().Add(5 * time.Second); ; {
		m = get(t, ts.URL+"/metrics")
		all := true
		for _, line := range want {
			all = all && strings.Contains(m, line+"\n")
		}
		if all || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	for _, line := range want {
		if !strings.Contains(m, line+"\n") {
			t.Errorf("metrics lack %q:\n%s", line, m)
		}
	}
}

// attempt posts a chat request and says how it went: "200", "429", "500" or
// "drop".
func attempt(t *testing.T, url string, body []byte) string {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return "drop"
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return "drop"
	}
	if resp.StatusCode == 429 && resp.Header.Get("Retry-After") == "" {
		t.Errorf("429 without Retry-After")
	}
	if resp.StatusCode == 200 && bytes.HasPrefix(out, []byte("data: ")) && !bytes.HasSuffix(out, []byte("data: [DONE]\n\n")) {
		return "drop"
	}
	return fmt.Sprint(resp.StatusCode)
}

func TestFaultsByRate(t *testing.T) {
	const n = 200
	run := func(seed int64, rate float64) []string {
		ts := newServer(t, model.Options{Seed: seed, FailRate: rate})
		var out []string
		for i := range n {
			req := chatRequest([]map[string]any{{"role": "user", "content": fmt.Sprintf("task %d", i)}}, nil, i%2 == 0)
			b, _ := json.Marshal(req)
			out = append(out, attempt(t, ts.URL, b))
		}
		return out
	}
	a := run(5, 0.3)
	counts := map[string]int{}
	for _, o := range a {
		counts[o]++
	}
	failed := n - counts["200"]
	if failed < n*15/100 || failed > n*45/100 || counts["429"] == 0 || counts["500"] == 0 || counts["drop"] == 0 {
		t.Errorf("rate 0.3 over %d requests: %v", n, counts)
	}
	if b := run(5, 0.3); fmt.Sprint(a) != fmt.Sprint(b) {
		t.Error("the same seed injected different faults")
	}
	for _, o := range run(5, 0) {
		if o != "200" {
			t.Fatalf("rate 0 gave %s", o)
		}
	}
	// A retried request gets a fresh draw, so retries succeed eventually;
	// "none" in the header turns faults off.
	ts := newServer(t, model.Options{Seed: 9, FailRate: 0.5})
	b, _ := json.Marshal(chatRequest(userMessages(), nil, false))
	ok := false
	for range 40 {
		if attempt(t, ts.URL, b) == "200" {
			ok = true
			break
		}
	}
	if !ok {
		t.Error("40 retries at rate 0.5 all failed")
	}
	always := newServer(t, model.Options{FailRate: 1})
	if code, _, body := post(t, always.URL+"/v1/chat/completions", b, model.FaultHeader, "none"); code != 200 {
		t.Errorf("fault none at rate 1: %d %s", code, body)
	}
}

func TestBadInput(t *testing.T) {
	ts := newServer(t, model.Options{MaxBodyBytes: 1 << 10})
	url := ts.URL + "/v1/chat/completions"
	for _, tc := range []struct {
		body string
		code int
		says string
	}{
		{`{"messages": [`, 400, "not a valid chat-completions JSON"},
		{`[]`, 400, "not a valid"},
		{`{"model": "x"}`, 400, `"messages" is missing`},
		{`{"messages": [{"content": "hi"}]}`, 400, `"role" is missing`},
		{`{"messages": [{"role": "user", "content": 5}]}`, 400, "content must be"},
		{`{"messages": [{"role": "user", "content": "` + strings.Repeat("x", 2<<10) + `"}]}`, 413, "over 1024 bytes"},
	} {
		code, _, body := post(t, url, tc.body)
		var e oaError
		if code != tc.code || json.Unmarshal(body, &e) != nil || !strings.Contains(e.Error.Message, tc.says) || e.Error.Type != "invalid_request_error" {
			t.Errorf("%.40s: status %d, %s; want %d saying %q", tc.body, code, body, tc.code, tc.says)
		}
	}
	// The default limit is 8 MiB.
	def := newServer(t, model.Options{})
	big := `{"messages": [{"role": "user", "content": "` + strings.Repeat("x", 9<<20) + `"}]}`
	if code, _, _ := post(t, def.URL+"/v1/chat/completions", big); code != 413 {
		t.Errorf("9 MiB body: status %d, want 413", code)
	}
	// An unknown model is accepted and echoed back; an empty one is the server's.
	_, _, body := post(t, url, `{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}`)
	if c := completion(t, body); c.Model != "no-such-model" {
		t.Errorf("model %q", c.Model)
	}
	_, _, body = post(t, url, `{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}`)
	if c := completion(t, body); c.Model != model.DefaultName {
		t.Errorf("model %q", c.Model)
	}
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 || resp.Header.Get("Allow") != "POST" {
		t.Errorf("GET chat: %d", resp.StatusCode)
	}
	if code, _, _ := post(t, ts.URL+"/v1/embeddings", `{}`); code != 404 {
		t.Errorf("unknown endpoint: %d", code)
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	return string(b)
}

func TestModelsHealthAndMetrics(t *testing.T) {
	ts := newServer(t, model.Options{Name: "scripted-x"})
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(get(t, ts.URL+"/v1/models")), &list); err != nil || list.Object != "list" ||
		len(list.Data) != 1 || list.Data[0].ID != "scripted-x" || list.Data[0].Object != "model" {
		t.Errorf("models: %+v %v", list, err)
	}
	if h := get(t, ts.URL+"/healthz"); h != "ok\n" {
		t.Errorf("healthz %q", h)
	}
	_, _, body := post(t, ts.URL+"/chat/completions", chatRequest(userMessages(), nil, false)) // without /v1 too
	c := completion(t, body)
	m := get(t, ts.URL+"/metrics")
	for _, line := range []string{
		"# TYPE stasis_model_requests_total counter",
		`stasis_model_requests_total{endpoint="chat_completions",code="200"} 1`,
		`stasis_model_requests_total{endpoint="models",code="200"} 1`,
		fmt.Sprintf("stasis_model_prompt_tokens_total %d", c.Usage.PromptTokens),
		fmt.Sprintf("stasis_model_completion_tokens_total %d", c.Usage.CompletionTokens),
		`stasis_model_faults_injected_total{kind="drop"} 0`,
	} {
		if !strings.Contains(m, line+"\n") {
			t.Errorf("metrics lack %q:\n%s", line, m)
		}
	}
}

func TestTokenDelay(t *testing.T) {
	const delay = 2 * time.Millisecond
	ts := newServer(t, model.Options{TokenDelay: delay})
	start := time.Now()
	_, _, body := post(t, ts.URL+"/v1/chat/completions", chatRequest(userMessages(), miniTools, false))
	n := len(completion(t, body).Choices[0].TokenIDs)
	if el := time.Since(start); el < time.Duration(n)*delay {
		t.Errorf("non-stream: %d tokens took %v, want at least %v", n, el, time.Duration(n)*delay)
	}
	start = time.Now()
	s := readStream(t, ts.URL, chatRequest(userMessages(), miniTools, true))
	if el := time.Since(start); el < time.Duration(len(s.ids))*delay || !s.done {
		t.Errorf("stream: %d tokens took %v", len(s.ids), el)
	}
}

type oaResponse struct {
	ID        string `json:"id"`
	Object    string `json:"object"`
	CreatedAt int64  `json:"created_at"`
	Status    string `json:"status"`
	Model     string `json:"model"`
	Output    []struct {
		Type    string `json:"type"`
		ID      string `json:"id"`
		Role    string `json:"role"`
		Content []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"content"`
		CallID    string `json:"call_id"`
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"output"`
	Usage struct {
		InputTokens  int `json:"input_tokens"`
		OutputTokens int `json:"output_tokens"`
		TotalTokens  int `json:"total_tokens"`
	} `json:"usage"`
	PromptTokenIDs []int64 `json:"prompt_token_ids"`
	TokenIDs       []int64 `json:"token_ids"`
}

func TestResponsesAPI(t *testing.T) {
	ts := newServer(t, model.Options{})
	respTools := []map[string]any{{"type": "function", "name": "read", "parameters": map[string]any{"type": "object"}}, {"type": "function", "name": "bash"}}
	input := []map[string]any{{"role": "user", "content": "fix it"}}
	var got []string
	for turn := 0; turn < 5; turn++ {
		req := map[string]any{"model": "m", "instructions": "be brief", "input": input, "tools": respTools}
		code, _, body := post(t, ts.URL+"/v1/responses", req)
		var r oaResponse
		if code != 200 || json.Unmarshal(body, &r) != nil || r.Object != "response" || r.Status != "completed" || !strings.HasPrefix(r.ID, "resp_") {
			t.Fatalf("turn %d: %d %s", turn, code, body)
		}
		if r.Usage.InputTokens != len(r.PromptTokenIDs) || r.Usage.OutputTokens != len(r.TokenIDs) || r.Usage.TotalTokens != len(r.PromptTokenIDs)+len(r.TokenIDs) {
			t.Errorf("turn %d: usage %+v", turn, r.Usage)
		}
		// The stream ends with response.completed holding the same response.
		sreq := map[string]any{"model": "m", "instructions": "be brief", "input": input, "tools": respTools, "stream": true}
		code, _, sbody := post(t, ts.URL+"/v1/responses", sreq)
		events := strings.Split(strings.TrimSpace(string(sbody)), "\n\n")
		last := events[len(events)-1]
		if code != 200 || !strings.HasPrefix(events[0], "event: response.created\n") || !strings.HasPrefix(last, "event: response.completed\ndata: ") {
			t.Fatalf("turn %d: stream %d %s", turn, code, sbody)
		}
		var done struct {
			Type     string     `json:"type"`
			Sequence int        `json:"sequence_number"`
			Response oaResponse `json:"response"`
		}
		if err := json.Unmarshal([]byte(strings.SplitN(last, "data: ", 2)[1]), &done); err != nil || done.Sequence != len(events)-1 ||
			fmt.Sprint(done.Response.TokenIDs) != fmt.Sprint(r.TokenIDs) || len(done.Response.Output) != len(r.Output) {
			t.Errorf("turn %d: completed event %v %+v", turn, err, done)
		}
		var deltas string
		for _, ev := range events {
			if strings.HasPrefix(ev, "event: response.function_call_arguments.delta\n") || strings.HasPrefix(ev, "event: response.output_text.delta\n") {
				var d struct {
					Delta string `json:"delta"`
				}
				_ = json.Unmarshal([]byte(strings.SplitN(ev, "data: ", 2)[1]), &d)
				deltas += d.Delta
			}
		}
		out := r.Output[len(r.Output)-1]
		if out.Type == "message" {
			if out.Role != "assistant" || len(out.Content) != 1 || out.Content[0].Type != "output_text" || deltas != out.Content[0].Text {
				t.Errorf("message %+v, deltas %q", out, deltas)
			}
			got = append(got, "answer")
			break
		}
		if out.Type != "function_call" || !strings.HasPrefix(out.CallID, "call_") || deltas != out.Arguments {
			t.Fatalf("turn %d: output %+v, deltas %q", turn, out, deltas)
		}
		got = append(got, out.Name)
		input = append(input,
			map[string]any{"type": "function_call", "call_id": out.CallID, "name": out.Name, "arguments": out.Arguments},
			map[string]any{"type": "function_call_output", "call_id": out.CallID, "output": "done"})
	}
	if fmt.Sprint(got) != "[read bash answer]" {
		t.Errorf("responses conversation: %v", got)
	}
	var e oaError
	if code, _, body := post(t, ts.URL+"/v1/responses", `{"model": "m"}`); code != 400 || json.Unmarshal(body, &e) != nil || !strings.Contains(e.Error.Message, `"input" is missing`) {
		t.Errorf("no input: %d %s", code, body)
	}
}

func TestTokenizer(t *testing.T) {
	for _, s := range []string{"", "hello", "héllo ✓ 日本", "\x00\xff\xfe", "<|im_start|>"} {
		ids := model.Tokenize(s)
		if len(ids) != len(s) {
			t.Errorf("%q: %d ids", s, len(ids))
		}
		for _, id := range ids {
			if id < model.ByteOffset || id >= model.VocabSize {
				t.Errorf("%q: id %d out of the byte range", s, id)
			}
		}
		if got := detok(t, ids); got != s {
			t.Errorf("round trip %q -> %q", s, got)
		}
	}
	if s := detok(t, []int64{model.TokenIMStart, model.ByteOffset + 'a', model.TokenToolCall}); s != "<|im_start|>a<tool_call>" {
		t.Errorf("specials: %q", s)
	}
	for _, bad := range [][]int64{{-1}, {model.VocabSize}, {9}} {
		if _, err := model.Detokenize(bad); err == nil || !strings.Contains(err.Error(), "not in the vocabulary") {
			t.Errorf("%v: %v", bad, err)
		}
	}
}

func TestParseScript(t *testing.T) {
	s, err := model.ParseScript([]byte(`[{"tool_calls": [{"name": "run", "arguments": {"command": "ls"}}]}, {"content": "ok"}]`))
	if err != nil || len(s.Turns) != 2 || string(s.Turns[0].ToolCalls[0].Arguments) != `{"command":"ls"}` {
		t.Fatalf("list form: %+v %v", s, err)
	}
	for _, tc := range []struct{ in, says string }{
		{`{"turns": []}`, "no turns"},
		{`[{}]`, `turn 0: give "content"`},
		{`[{"tool_calls": [{"arguments": {}}]}]`, `"name" is empty`},
		{`[{"tool_calls": [{"name": "x", "arguments": [1]}]}]`, "must be a JSON object"},
		{`[{"tool_calls": [{"name": "x", "arguments": "nope"}]}]`, "must be a JSON object"},
		{`[{"text": "hi"}]`, "unknown field"},
		{`{"turns": [{"content": "a"}]} x`, "trailing data"},
		{`nope`, "not a JSON script"},
	} {
		if _, err := model.ParseScript([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want %q", tc.in, err, tc.says)
		}
	}
	if _, err := model.LoadScript(filepath.Join(t.TempDir(), "missing.json")); err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("missing file: %v", err)
	}
	if d := model.DefaultScript(); len(d.Turns) != 3 || d.Turns[2].Content == "" {
		t.Errorf("default script %+v", d)
	}
}

// With Scripts, a conversation whose user message holds a script's Match
// (even with its quotes escaped, as OpenCode sends a prompt) plays that
// script; any other plays the Script.
func TestScriptsSelectedByMatch(t *testing.T) {
	fix := &model.Script{Name: "fix", Match: `the "total" is wrong`, Turns: []model.Turn{{Content: "fix answer"}}}
	other := &model.Script{Name: "other", Match: "unrelated", Turns: []model.Turn{{Content: "other answer"}}}
	srv := httptest.NewServer(model.New(model.Options{Script: &model.Script{Turns: []model.Turn{{Content: "default answer"}}}, Scripts: []*model.Script{other, fix}}))
	defer srv.Close()
	for _, c := range []struct{ user, want string }{
		{`Bug: the "total" is wrong for two items.`, "fix answer"},
		{`"Bug: the \"total\" is wrong for two items."`, "fix answer"},
		{"something unrelated", "other answer"},
		{"hello", "default answer"},
	} {
		code, _, body := post(t, srv.URL+"/v1/chat/completions", map[string]any{
			"model": model.DefaultName, "messages": []map[string]any{{"role": "system", "content": `the "total" is wrong`}, {"role": "user", "content": c.user}},
		})
		if code != 200 || !strings.Contains(string(body), c.want) {
			t.Errorf("%q: %d %s, want %q", c.user, code, body, c.want)
		}
	}
}
