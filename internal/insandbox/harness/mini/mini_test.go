package mini_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/insandbox/harness/mini"
	"stasis/internal/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// server is the scripted model behind a handler that records every request
// body and lets a test answer chosen requests itself.
type server struct {
	*httptest.Server
	mu     sync.Mutex
	bodies [][]byte
}

// hook answers request n (1-based) itself when it returns true.
type hook func(n int, w http.ResponseWriter, r *http.Request) bool

func newServer(t *testing.T, script *model.Script, h hook) *server {
	t.Helper()
	m := model.New(model.Options{Script: script})
	s := &server{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.bodies = append(s.bodies, body)
		n := len(s.bodies)
		s.mu.Unlock()
		if h != nil && h(n, w, r) {
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		m.ServeHTTP(w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *server) endpoint() string { return s.URL + "/v1" }

func (s *server) requests() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]byte(nil), s.bodies...)
}

// request is the part of a chat request the tests read; messages stay raw.
type request struct {
	Model    string            `json:"model"`
	Messages []json.RawMessage `json:"messages"`
	Tools    []struct {
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	} `json:"tools"`
	Stream bool `json:"stream"`
}

func parseRequest(t *testing.T, body []byte) request {
	t.Helper()
	var r request
	if err := json.Unmarshal(body, &r); err != nil {
		t.Fatalf("request body is not JSON: %v\n%s", err, body)
	}
	return r
}

type msg struct {
	Role       string `json:"role"`
	Content    any    `json:"content"`
	ToolCallID string `json:"tool_call_id"`
	ToolCalls  []struct {
		ID string `json:"id"`
	} `json:"tool_calls"`
}

func parseMsg(t *testing.T, raw json.RawMessage) msg {
	t.Helper()
	var m msg
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// toolText is the content of a tool message.
func toolText(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	m := parseMsg(t, raw)
	if m.Role != "tool" {
		t.Fatalf("not a tool message: %s", raw)
	}
	s, _ := m.Content.(string)
	return s
}

// savedMessages reads the messages of a session file, raw.
func savedMessages(t *testing.T, path string) []json.RawMessage {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Format   string            `json:"format"`
		Version  int               `json:"version"`
		Messages []json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatalf("session file is not JSON: %v\n%s", err, b)
	}
	if f.Format != mini.SessionFormat || f.Version != mini.SessionVersion {
		t.Fatalf("session file format %q version %d", f.Format, f.Version)
	}
	return f.Messages
}

// samePrefix fails unless got starts with want, byte for byte.
func samePrefix(t *testing.T, what string, want, got []json.RawMessage) {
	t.Helper()
	if len(got) < len(want) {
		t.Fatalf("%s: %d messages, want at least %d", what, len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(want[i], got[i]) {
			t.Fatalf("%s: message %d differs:\nwant %s\ngot  %s", what, i, want[i], got[i])
		}
	}
}

func call(t *testing.T, name string, args map[string]string) model.ScriptCall {
	t.Helper()
	b, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	return model.ScriptCall{Name: name, Arguments: b}
}

func calls(c ...model.ScriptCall) model.Turn { return model.Turn{ToolCalls: c} }

func answer(s string) model.Turn { return model.Turn{Content: s} }

func config(srv *server, dir string, progress io.Writer) mini.Config {
	return mini.Config{
		Endpoint: srv.endpoint(), Model: model.DefaultName, WorkDir: filepath.Join(dir, "work"),
		SessionFile: filepath.Join(dir, "state", "session.json"), Prompt: "fix the greeting",
		CommandTimeout: time.Minute, Log: progress,
	}
}

func workdir(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		p := filepath.Join(dir, "work", name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "work"), 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestFullRun(t *testing.T) {
	dir := workdir(t, map[string]string{"greet.txt": "helo world\n"})
	script := &model.Script{Turns: []model.Turn{
		calls(call(t, "read_file", map[string]string{"path": "greet.txt"})),
		calls(call(t, "edit_file", map[string]string{"path": "greet.txt", "old": "helo", "new": "hello"})),
		calls(
			call(t, "write_file", map[string]string{"path": "sub/dir/new.txt", "content": "new file\n"}),
			call(t, "run", map[string]string{"command": "cat greet.txt sub/dir/new.txt; echo oops >&2; exit 3"}),
		),
		answer("The greeting is fixed."),
	}}
	srv := newServer(t, script, nil)
	var progress bytes.Buffer
	cfg := config(srv, dir, &progress)
	res, err := mini.Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	want := mini.Result{Done: true, Answer: "The greeting is fixed.", Steps: 4, ModelCalls: 4, ToolCalls: 4, SessionFile: cfg.SessionFile}
	if res != want {
		t.Fatalf("result %+v, want %+v", res, want)
	}
	if got := readFile(t, filepath.Join(dir, "work", "greet.txt")); got != "hello world\n" {
		t.Errorf("greet.txt = %q", got)
	}
	if got := readFile(t, filepath.Join(dir, "work", "sub", "dir", "new.txt")); got != "new file\n" {
		t.Errorf("new.txt = %q", got)
	}

	reqs := srv.requests()
	if len(reqs) != 4 {
		t.Fatalf("%d requests, want 4", len(reqs))
	}
	var prev []json.RawMessage
	for i, body := range reqs {
		r := parseRequest(t, body)
		if r.Model != model.DefaultName || r.Stream {
			t.Errorf("request %d: model %q stream %v", i+1, r.Model, r.Stream)
		}
		var names []string
		for _, tool := range r.Tools {
			names = append(names, tool.Function.Name)
		}
		if strings.Join(names, ",") != "run,read_file,write_file,edit_file" {
			t.Errorf("request %d offers tools %v", i+1, names)
		}
		// Each request re-sends the history of the one before, byte for byte.
		samePrefix(t, "request history", prev, r.Messages)
		prev = r.Messages
	}
	last := parseRequest(t, reqs[3]).Messages
	if len(last) != 9 {
		t.Fatalf("last request has %d messages, want 9 (system, user, 3 replies, 4 results)", len(last))
	}
	if m := parseMsg(t, last[0]); m.Role != "system" {
		t.Errorf("first message is %s", m.Role)
	}
	if m := parseMsg(t, last[1]); m.Role != "user" || m.Content != "fix the greeting" {
		t.Errorf("second message %s", last[1])
	}
	if got := toolText(t, last[3]); got != "helo world\n" {
		t.Errorf("read_file result %q", got)
	}
	if got := toolText(t, last[5]); !strings.Contains(got, "replaced 1 occurrence") {
		t.Errorf("edit_file result %q", got)
	}
	if got := toolText(t, last[7]); !strings.Contains(got, "wrote 9 bytes") {
		t.Errorf("write_file result %q", got)
	}
	if got := toolText(t, last[8]); got != "exit code: 3\nhello world\nnew file\noops\n" {
		t.Errorf("run result %q", got)
	}
	// Tool messages answer the calls of the reply before them.
	reply := parseMsg(t, last[6])
	if len(reply.ToolCalls) != 2 || parseMsg(t, last[7]).ToolCallID != reply.ToolCalls[0].ID || parseMsg(t, last[8]).ToolCallID != reply.ToolCalls[1].ID {
		t.Errorf("tool_call_ids do not match the calls: %s", last[6])
	}
	for _, line := range []string{
		"step 1: read_file greet.txt → 11 bytes",
		"step 2: edit_file greet.txt → replaced 1 occurrence",
		"step 3: write_file sub/dir/new.txt → 9 bytes",
		"step 3: run `cat greet.txt sub/dir/new.txt; echo oops >&2; exit 3` → exit 3",
		"step 4: final answer: The greeting is fixed.",
	} {
		if !strings.Contains(progress.String(), line+"\n") {
			t.Errorf("progress lacks %q:\n%s", line, progress.String())
		}
	}

	// The saved session holds the final history; running it again returns
	// the answer without calling the model.
	saved := savedMessages(t, cfg.SessionFile)
	if len(saved) != 10 {
		t.Fatalf("session has %d messages, want 10", len(saved))
	}
	samePrefix(t, "session", last, saved)
	before := readFile(t, cfg.SessionFile)
	res, err = mini.Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	want.ModelCalls, want.ToolCalls, want.Resumed = 0, 0, true
	if res != want {
		t.Fatalf("finished session: result %+v, want %+v", res, want)
	}
	if n := len(srv.requests()); n != 4 {
		t.Fatalf("a finished session called the model: %d requests", n)
	}
	if readFile(t, cfg.SessionFile) != before {
		t.Error("a finished session's file changed")
	}
}

func TestResumeAfterCrashBetweenSteps(t *testing.T) {
	dir := workdir(t, nil)
	script := &model.Script{Turns: []model.Turn{
		calls(call(t, "run", map[string]string{"command": "echo one >> log.txt"})),
		calls(call(t, "run", map[string]string{"command": "echo two >> log.txt"})),
		calls(call(t, "run", map[string]string{"command": "echo three >> log.txt"})),
		answer("Logged three lines."),
	}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := newServer(t, script, func(n int, w http.ResponseWriter, r *http.Request) bool {
		if n != 3 {
			return false
		}
		// The agent dies while its third model call is under way.
		cancel()
		select {
		case <-r.Context().Done():
		case <-time.After(30 * time.Second):
		}
		return true
	})
	var progress bytes.Buffer
	cfg := config(srv, dir, &progress)
	res, err := mini.Run(ctx, cfg)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("first run: %v, want context.Canceled", err)
	}
	if res.Done || res.Steps != 2 || res.ModelCalls != 3 || res.ToolCalls != 2 {
		t.Fatalf("first run result %+v", res)
	}
	saved := savedMessages(t, cfg.SessionFile)
	if len(saved) != 6 {
		t.Fatalf("saved %d messages, want 6 (system, user, 2 replies, 2 results)", len(saved))
	}
	crashed := parseRequest(t, srv.requests()[2]).Messages
	if len(crashed) != len(saved) {
		t.Fatalf("the interrupted request had %d messages, the session %d", len(crashed), len(saved))
	}
	samePrefix(t, "interrupted request vs session", saved, crashed)

	progress.Reset()
	cfg.Prompt = "a different prompt, to be ignored"
	res, err = mini.Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("resumed run: %v\n%s", err, progress.String())
	}
	want := mini.Result{Done: true, Answer: "Logged three lines.", Steps: 4, ModelCalls: 2, ToolCalls: 1, Resumed: true, SessionFile: cfg.SessionFile}
	if res != want {
		t.Fatalf("resumed result %+v, want %+v", res, want)
	}
	reqs := srv.requests()
	if len(reqs) != 5 {
		t.Fatalf("%d requests, want 5", len(reqs))
	}
	// The first request after the resume is the saved history, byte for
	// byte: the very request the crash interrupted.
	if !bytes.Equal(reqs[3], reqs[2]) {
		t.Fatalf("the resumed request differs from the interrupted one:\n%s\n%s", reqs[2], reqs[3])
	}
	first := parseRequest(t, reqs[3]).Messages
	samePrefix(t, "resumed request", saved, first)
	if len(first) != len(saved) {
		t.Fatalf("resumed request has %d messages, want %d", len(first), len(saved))
	}
	samePrefix(t, "last request", first, parseRequest(t, reqs[4]).Messages)
	if m := parseMsg(t, first[1]); m.Content != "fix the greeting" {
		t.Errorf("the resumed conversation's prompt is %v", m.Content)
	}
	if got := readFile(t, filepath.Join(dir, "work", "log.txt")); got != "one\ntwo\nthree\n" {
		t.Errorf("log.txt = %q: a tool ran twice or not at all", got)
	}
	if !strings.Contains(progress.String(), "the prompt given is ignored") {
		t.Errorf("resume did not say the prompt is ignored:\n%s", progress.String())
	}
}

func TestResumeRunsPendingToolCall(t *testing.T) {
	dir := workdir(t, nil)
	work := filepath.Join(dir, "work")
	script := &model.Script{Turns: []model.Turn{
		// The first time, the command blocks until the agent is killed.
		calls(call(t, "run", map[string]string{"command": "echo run >> count.txt; [ -e release ] || exec sleep 600"})),
		answer("Counted."),
	}}
	srv := newServer(t, script, nil)
	cfg := config(srv, dir, io.Discard)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := mini.Run(ctx, cfg)
		done <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		// The shell creates count.txt before it writes the line: wait for
		// the line, or a kill in between leaves the file empty.
		if b, err := os.ReadFile(filepath.Join(work, "count.txt")); err == nil && string(b) == "run\n" {
			break
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("the command did not start within 30s")
		}
		time.Sleep(5 * time.Millisecond) // poll interval, bounded by the deadline
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("first run: %v, want context.Canceled", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the agent did not stop within 30s of its context's end")
	}
	saved := savedMessages(t, cfg.SessionFile)
	if len(saved) != 3 || parseMsg(t, saved[2]).Role != "assistant" {
		t.Fatalf("saved %d messages, want system, user and the reply with the call", len(saved))
	}

	if err := os.WriteFile(filepath.Join(work, "release"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := mini.Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Done || res.Answer != "Counted." || res.ToolCalls != 1 || res.ModelCalls != 1 || res.Steps != 2 {
		t.Fatalf("resumed result %+v", res)
	}
	reqs := srv.requests()
	if len(reqs) != 2 {
		t.Fatalf("%d requests, want 2", len(reqs))
	}
	first := parseRequest(t, reqs[1]).Messages
	samePrefix(t, "resumed request", saved, first)
	if len(first) != 4 {
		t.Fatalf("resumed request has %d messages, want 4", len(first))
	}
	if got := toolText(t, first[3]); got != "exit code: 0\n(no output)" {
		t.Errorf("the pending call's result %q", got)
	}
	if id := parseMsg(t, saved[2]).ToolCalls[0].ID; parseMsg(t, first[3]).ToolCallID != id {
		t.Errorf("the result answers %q, want %q", parseMsg(t, first[3]).ToolCallID, id)
	}
	// The call had no saved result, so it ran again: twice in all.
	if got := readFile(t, filepath.Join(work, "count.txt")); got != "run\nrun\n" {
		t.Errorf("count.txt = %q", got)
	}
}

func TestBadSessionFile(t *testing.T) {
	cases := []struct {
		name, content, says string
	}{
		{"garbage", "this is not json\n", "not a mini session"},
		{"empty", "", "not a mini session"},
		{"other format", `{"format": "something-else", "version": 1}`, "not a mini session"},
		{"wrong version", `{"format": "stasis-mini-session", "version": 99, "messages": [{"role": "user", "content": "x"}]}`, "version 99"},
		{"no version", `{"format": "stasis-mini-session", "messages": [{"role": "user", "content": "x"}]}`, "version missing"},
		{"no messages", `{"format": "stasis-mini-session", "version": 1, "messages": []}`, "no messages"},
		{"bad role", `{"format": "stasis-mini-session", "version": 1, "messages": [{"role": "wizard", "content": "x"}]}`, `unknown role "wizard"`},
		{"too many results", `{"format": "stasis-mini-session", "version": 1, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "done"}, {"role": "tool", "tool_call_id": "a", "content": "y"}]}`, "0 tool calls but 1 results"},
	}
	srv := newServer(t, nil, nil)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := workdir(t, nil)
			cfg := config(srv, dir, io.Discard)
			if err := os.MkdirAll(filepath.Dir(cfg.SessionFile), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(cfg.SessionFile, []byte(c.content), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := mini.Run(context.Background(), cfg)
			if err == nil || !strings.Contains(err.Error(), cfg.SessionFile) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("error %v, want one naming %s and saying %q", err, cfg.SessionFile, c.says)
			}
			if got := readFile(t, cfg.SessionFile); got != c.content {
				t.Fatalf("the session file changed: %q", got)
			}
			if left, _ := os.ReadDir(filepath.Dir(cfg.SessionFile)); len(left) != 1 {
				t.Fatalf("files beside the session: %v", left)
			}
		})
	}
	if n := len(srv.requests()); n != 0 {
		t.Fatalf("%d model calls for bad sessions", n)
	}
}

func TestRetries429And5xx(t *testing.T) {
	dir := workdir(t, map[string]string{"README.md": "hi\n"})
	srv := newServer(t, nil, func(n int, w http.ResponseWriter, r *http.Request) bool {
		switch n {
		case 1:
			w.Header().Set("Retry-After", "1")
			http.Error(w, `{"error": {"message": "slow down"}}`, http.StatusTooManyRequests)
			return true
		case 2:
			http.Error(w, `{"error": {"message": "overloaded"}}`, http.StatusServiceUnavailable)
			return true
		}
		return false
	})
	var progress bytes.Buffer
	start := time.Now()
	res, err := mini.Run(context.Background(), config(srv, dir, &progress))
	if err != nil {
		t.Fatalf("%v\n%s", err, progress.String())
	}
	if took := time.Since(start); took < time.Second {
		t.Errorf("took %s: the Retry-After of 1s was not honoured", took)
	}
	// The default script: three replies, the first after two failures.
	if !res.Done || res.Steps != 3 || res.ModelCalls != 5 {
		t.Fatalf("result %+v", res)
	}
	reqs := srv.requests()
	if len(reqs) != 5 || !bytes.Equal(reqs[0], reqs[1]) || !bytes.Equal(reqs[1], reqs[2]) {
		t.Fatalf("%d requests; the retries must repeat the request exactly", len(reqs))
	}
	if !strings.Contains(progress.String(), "429") || !strings.Contains(progress.String(), "503") {
		t.Errorf("progress does not show the retries:\n%s", progress.String())
	}
}

func TestClientErrorEndsTheRun(t *testing.T) {
	dir := workdir(t, nil)
	srv := newServer(t, nil, func(n int, w http.ResponseWriter, r *http.Request) bool {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error": {"message": "the context is too long"}}`)
		return true
	})
	cfg := config(srv, dir, io.Discard)
	res, err := mini.Run(context.Background(), cfg)
	var he *mini.HTTPError
	if !errors.As(err, &he) || he.Status != http.StatusBadRequest || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "the context is too long") {
		t.Fatalf("error %v, want one naming 400 and the body", err)
	}
	if res.Done || res.ModelCalls != 1 || len(srv.requests()) != 1 {
		t.Fatalf("result %+v, %d requests: a 400 must not be retried", res, len(srv.requests()))
	}
	// The session holds the prompt: a relaunch would send it again.
	if n := len(savedMessages(t, cfg.SessionFile)); n != 2 {
		t.Fatalf("session has %d messages, want 2", n)
	}
}

func TestToolErrorsGoBackToTheModel(t *testing.T) {
	const content = "dup and dup\n"
	dir := workdir(t, map[string]string{"f.txt": content})
	script := &model.Script{Turns: []model.Turn{
		calls(call(t, "edit_file", map[string]string{"path": "f.txt", "old": "absent", "new": "x"})),
		calls(call(t, "edit_file", map[string]string{"path": "f.txt", "old": "dup", "new": "x"})),
		calls(call(t, "run", map[string]string{"cmd": "ls"})),
		calls(call(t, "read_file", map[string]string{"path": "missing.txt"})),
		answer("I give up."),
	}}
	srv := newServer(t, script, nil)
	res, err := mini.Run(context.Background(), config(srv, dir, io.Discard))
	if err != nil {
		t.Fatal(err)
	}
	if !res.Done || res.Steps != 5 {
		t.Fatalf("result %+v", res)
	}
	reqs := srv.requests()
	for i, want := range []string{
		"error: edit_file: the old text was not found in f.txt",
		"error: edit_file: the old text occurs 2 times in f.txt",
		`error: run: "command" is missing`,
		"error: read_file: stat " + filepath.Join(dir, "work", "missing.txt") + ": no such file",
	} {
		msgs := parseRequest(t, reqs[i+1]).Messages
		if got := toolText(t, msgs[len(msgs)-1]); !strings.HasPrefix(got, want) {
			t.Errorf("request %d carries %q, want it to start with %q", i+2, got, want)
		}
	}
	if got := readFile(t, filepath.Join(dir, "work", "f.txt")); got != content {
		t.Errorf("a failed edit changed the file: %q", got)
	}
}

func TestMalformedCallsAndVerbatimHistory(t *testing.T) {
	dir := workdir(t, nil)
	// Pretty-printed, with characters json.Marshal would escape: the agent
	// must send it back exactly like this.
	const reply = `{
    "role": "assistant",
    "content": "Let me try <this> & that.",
    "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{not json"}},
      {"id": "c2", "type": "function", "function": {"name": "fly", "arguments": "{}"}},
      {"id": "c3", "type": "function", "function": {"name": "write_file", "arguments": "{\"path\": \"obj.txt\", \"content\": \"a <b> & c\"}"}}
    ]
  }`
	script := &model.Script{Turns: []model.Turn{answer("unused"), answer("Done.")}}
	srv := newServer(t, script, func(n int, w http.ResponseWriter, r *http.Request) bool {
		if n != 1 {
			return false
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": `+reply+`, "finish_reason": "tool_calls"}]}`)
		return true
	})
	cfg := config(srv, dir, io.Discard)
	res, err := mini.Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Done || res.Answer != "Done." || res.ToolCalls != 3 {
		t.Fatalf("result %+v", res)
	}
	msgs := parseRequest(t, srv.requests()[1]).Messages
	if len(msgs) != 6 || string(msgs[2]) != reply {
		t.Fatalf("the reply was not sent back verbatim:\n%s", msgs[2])
	}
	if got := toolText(t, msgs[3]); !strings.HasPrefix(got, "error: run: the arguments are not valid") {
		t.Errorf("malformed arguments gave %q", got)
	}
	if got := toolText(t, msgs[4]); !strings.Contains(got, `there is no tool "fly"`) {
		t.Errorf("unknown tool gave %q", got)
	}
	if got := readFile(t, filepath.Join(dir, "work", "obj.txt")); got != "a <b> & c" {
		t.Errorf("obj.txt = %q", got)
	}
	if ids := []string{parseMsg(t, msgs[3]).ToolCallID, parseMsg(t, msgs[4]).ToolCallID, parseMsg(t, msgs[5]).ToolCallID}; strings.Join(ids, ",") != "c1,c2,c3" {
		t.Errorf("tool_call_ids %v", ids)
	}
	// The session file keeps it verbatim too.
	if saved := savedMessages(t, cfg.SessionFile); string(saved[2]) != reply {
		t.Fatalf("the session changed the reply:\n%s", saved[2])
	}
}

func TestMaxSteps(t *testing.T) {
	dir := workdir(t, nil)
	script := &model.Script{Turns: []model.Turn{
		calls(call(t, "run", map[string]string{"command": "echo 1 >> n"})),
		calls(call(t, "run", map[string]string{"command": "echo 2 >> n"})),
		calls(call(t, "run", map[string]string{"command": "echo 3 >> n"})),
		answer("Three."),
	}}
	srv := newServer(t, script, nil)
	cfg := config(srv, dir, io.Discard)
	cfg.MaxSteps = 2
	res, err := mini.Run(context.Background(), cfg)
	if !errors.Is(err, mini.ErrMaxSteps) {
		t.Fatalf("error %v, want ErrMaxSteps", err)
	}
	if res.Done || res.Steps != 2 || res.ModelCalls != 2 || res.ToolCalls != 2 {
		t.Fatalf("result %+v", res)
	}
	// The limit is per session: a resume with a higher one goes on.
	cfg.MaxSteps = 4
	res, err = mini.Run(context.Background(), cfg)
	if err != nil || !res.Done || res.Steps != 4 || res.ModelCalls != 2 {
		t.Fatalf("resume: %+v, %v", res, err)
	}
	if got := readFile(t, filepath.Join(dir, "work", "n")); got != "1\n2\n3\n" {
		t.Errorf("n = %q", got)
	}
}

func TestOutputLimitAndTimeout(t *testing.T) {
	dir := workdir(t, map[string]string{"big.txt": strings.Repeat("abcdefghij", 100)})
	script := &model.Script{Turns: []model.Turn{
		calls(
			call(t, "run", map[string]string{"command": "seq 1 1000"}),
			call(t, "read_file", map[string]string{"path": "big.txt"}),
			call(t, "run", map[string]string{"command": "echo started; exec sleep 600"}),
		),
		answer("Done."),
	}}
	srv := newServer(t, script, nil)
	cfg := config(srv, dir, io.Discard)
	cfg.OutputLimit = 100
	cfg.CommandTimeout = 300 * time.Millisecond
	res, err := mini.Run(context.Background(), cfg)
	if err != nil || !res.Done {
		t.Fatalf("%+v, %v", res, err)
	}
	msgs := parseRequest(t, srv.requests()[1]).Messages
	out := toolText(t, msgs[3])
	if !strings.HasPrefix(out, "exit code: 0\n1\n2\n3\n") || !strings.HasSuffix(out, "998\n999\n1000\n") || !strings.Contains(out, "bytes of output left out") {
		t.Errorf("long output kept as %q", out)
	}
	if got := toolText(t, msgs[4]); !strings.HasPrefix(got, strings.Repeat("abcdefghij", 10)+"\n[truncated: the first 100 of 1000 bytes") {
		t.Errorf("long file kept as %q", got)
	}
	if got := toolText(t, msgs[5]); !strings.Contains(got, "timed out after 300ms") || !strings.Contains(got, "started") {
		t.Errorf("timed-out command gave %q", got)
	}
}

func TestCLI(t *testing.T) {
	dir := workdir(t, map[string]string{"README.md": "hello\n"})
	srv := newServer(t, nil, nil)
	session := filepath.Join(dir, "session.json")
	args := []string{"mini", "--endpoint", srv.endpoint(), "--model", model.DefaultName,
		"--workdir", filepath.Join(dir, "work"), "--session", session}

	out, errOut, code := stasistest.Run(t, nil, "", append(args, "--json", "--", "look", "around")...)
	var res mini.Result
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil || !res.Done || res.Steps != 3 || res.ModelCalls != 3 {
		t.Fatalf("exit %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	if !strings.Contains(errOut, "step 1: read_file README.md → 6 bytes\n") || !strings.Contains(errOut, "step 2: run `ls` → exit 0\n") {
		t.Errorf("progress on stderr:\n%s", errOut)
	}
	// Resumed without a prompt: the finished session's answer, no model call.
	out, errOut, code = stasistest.Run(t, nil, "", args...)
	if code != 0 || out != res.Answer+"\n" || len(srv.requests()) != 3 {
		t.Fatalf("resume: exit %d, stdout %q, stderr %s, %d requests", code, out, errOut, len(srv.requests()))
	}

	// Out of steps: exit 3.
	_, errOut, code = stasistest.Run(t, nil, "", "mini", "--endpoint", srv.endpoint(), "--model", model.DefaultName,
		"--workdir", filepath.Join(dir, "work"), "--session", filepath.Join(dir, "s2.json"), "--max-steps", "1", "--", "go")
	if code != 3 || !strings.Contains(errOut, "step limit") {
		t.Fatalf("max steps: exit %d, stderr %s", code, errOut)
	}
	// A bad session file: exit 1, naming it.
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, errOut, code = stasistest.Run(t, nil, "", "mini", "--endpoint", srv.endpoint(), "--model", "m", "--session", bad, "--", "go")
	if code != 1 || !strings.Contains(errOut, bad) {
		t.Fatalf("bad session: exit %d, stderr %s", code, errOut)
	}

	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"mini", "--model", "m", "--session", session, "--", "go"}, "--endpoint is required"},
		{[]string{"mini", "--endpoint", srv.endpoint(), "--session", session, "--", "go"}, "--model is required"},
		{[]string{"mini", "--endpoint", srv.endpoint(), "--model", "m", "--", "go"}, "--session is required"},
		{[]string{"mini", "--endpoint", srv.endpoint(), "--model", "m", "--session", session, "go"}, "after --"},
		{[]string{"mini", "--endpoint", srv.endpoint(), "--model", "m", "--session", filepath.Join(dir, "none.json")}, "no prompt"},
		{[]string{"mini", "--endpoint", srv.endpoint(), "--model", "m", "--session", session, "--max-steps", "0", "--", "go"}, "--max-steps"},
	} {
		_, errOut, code := stasistest.Run(t, nil, "", c.args...)
		if code != 2 || !strings.Contains(errOut, c.says) {
			t.Errorf("%v: exit %d, stderr %q; want 2 saying %q", c.args, code, errOut, c.says)
		}
	}
	out, _, code = stasistest.Run(t, nil, "", "mini", "--help")
	for _, w := range []string{"run", "read_file", "write_file", "edit_file", "session file", "resume"} {
		if code != 0 || !strings.Contains(out, w) {
			t.Errorf("mini --help (exit %d) does not mention %q", code, w)
		}
	}
}
