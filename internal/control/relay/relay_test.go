package relay

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"stasis/internal/control/serve"
	"stasis/internal/ssecheck"
	"stasis/internal/testwait"
)

const completion = `{"id":"c1","object":"chat.completion","created":7,"model":"m","prompt_token_ids":[1,2,3],
"choices":[{"index":0,"message":{"role":"assistant","content":"hello","tool_calls":[{"id":"t1","type":"function","function":{"name":"read","arguments":"{\"path\":\"a\"}"}}]},"finish_reason":"tool_calls","token_ids":[9,8],"logprobs":{"content":[{"token":"h","logprob":-0.5}]}}],
"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},"vendor_extra":{"kept":true}}`

// upstreamCall is what the fake upstream saw.
type upstreamCall struct {
	callID, attempt, auth string
	body                  map[string]any
}

// fakeUpstream answers with handler, recording every call.
type fakeUpstream struct {
	mu      sync.Mutex
	calls   []upstreamCall
	handler func(w http.ResponseWriter, r *http.Request, n int)
	srv     *httptest.Server
}

func newFakeUpstream(t *testing.T, h func(w http.ResponseWriter, r *http.Request, n int)) *fakeUpstream {
	f := &fakeUpstream{handler: h}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		f.mu.Lock()
		f.calls = append(f.calls, upstreamCall{r.Header.Get(HeaderCallID), r.Header.Get(HeaderAttempt), r.Header.Get("Authorization"), body})
		n := len(f.calls)
		f.mu.Unlock()
		f.handler(w, r, n)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeUpstream) seen() []upstreamCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]upstreamCall(nil), f.calls...)
}

func writeCreds(t *testing.T, path string, c Credentials) {
	t.Helper()
	b, _ := json.Marshal(c)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func newTestRelay(t *testing.T, upstream string) (*Relay, *httptest.Server, string) {
	t.Helper()
	tok := filepath.Join(t.TempDir(), "token.json")
	writeCreds(t, tok, Credentials{Episode: "ep", Token: "secret", Attempt: 0})
	r, err := New(Config{Upstream: upstream, TokenFile: tok, MaxBody: 1 << 16, Retry: Retry{Initial: time.Millisecond, MaxInterval: 5 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler())
	t.Cleanup(srv.Close)
	return r, srv, tok
}

func post(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, what, 10*time.Second, cond)
}

func TestStoreAndForwardAsStream(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, completion)
	})
	_, srv, _ := newTestRelay(t, up.srv.URL)
	resp, body := post(t, srv.URL, `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}],"vendor_req":{"x":1}}`)
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("%d %s\n%s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
	}
	// Upstream got stream off, the unknown field untouched, the token and a call id.
	c := up.seen()[0]
	if c.body["stream"] != false || c.body["stream_options"] != nil || c.body["vendor_req"].(map[string]any)["x"].(float64) != 1 {
		t.Fatalf("upstream body %v", c.body)
	}
	if c.callID != "ep/1" || c.attempt != "0" || c.auth != "Bearer secret" {
		t.Fatalf("upstream headers %+v", c)
	}
	evs, err := ParseSSE(bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, err := AssembleChat(evs)
	if err != nil {
		t.Fatal(err)
	}
	var a, b map[string]any
	_ = json.Unmarshal(got, &a)
	_ = json.Unmarshal([]byte(completion), &b)
	am := a["choices"].([]any)[0].(map[string]any)
	bm := b["choices"].([]any)[0].(map[string]any)
	if mustJSON(am["message"]) != mustJSON(bm["message"]) || am["finish_reason"] != "tool_calls" || mustJSON(am["token_ids"]) != "[9,8]" {
		t.Fatalf("re-assembled choice %s\nwant %s", mustJSON(am), mustJSON(bm))
	}
	if mustJSON(a["vendor_extra"]) != `{"kept":true}` || mustJSON(a["prompt_token_ids"]) != "[1,2,3]" || a["usage"] == nil {
		t.Fatalf("unknown response fields lost: %s", got)
	}
	// Non-stream: byte-identical.
	_, plain := post(t, srv.URL, `{"model":"m","messages":[]}`)
	if string(plain) != completion {
		t.Fatalf("non-stream answer changed:\n%s", plain)
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestHoldWaitsForInFlightThenDeliversOnce(t *testing.T) {
	release := make(chan struct{})
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		<-release
		_, _ = io.WriteString(w, completion)
	})
	r, srv, _ := newTestRelay(t, up.srv.URL)
	got := make(chan []byte, 2)
	go func() {
		_, b := post(t, srv.URL, `{"messages":[]}`)
		got <- b
	}()
	eventually(t, "the call reaches upstream", func() bool { return len(up.seen()) == 1 })
	d, err := r.Hold()
	if err != nil || d.Delivered != 0 || d.Position != 0 {
		t.Fatalf("hold: %+v %v", d, err)
	}
	close(release) // the response completes during the hold
	eventually(t, "the completed call waits on the hold", func() bool { return testutil.ToFloat64(r.m.held) == 1 })
	select {
	case b := <-got:
		t.Fatalf("delivered during the hold: %s", b)
	default:
	}
	// A new call during the hold does not go upstream.
	go func() {
		_, b := post(t, srv.URL, `{"messages":[{"role":"user","content":"2"}]}`)
		got <- b
	}()
	eventually(t, "the new call waits on the hold", func() bool { return testutil.ToFloat64(r.m.held) == 2 })
	if n := len(up.seen()); n != 1 {
		t.Fatalf("%d upstream calls during the hold", n)
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if b := <-got; string(b) != completion {
			t.Fatalf("delivery %d: %s", i, b)
		}
	}
	// The count moves once the handler has flushed the whole response,
	// which may be just after the client read it.
	eventually(t, "both deliveries are counted", func() bool { return r.Delivered() == 2 })
	if len(up.seen()) != 2 {
		t.Fatalf("upstream calls %d", len(up.seen()))
	}
}

func TestReissueAfterRestore(t *testing.T) {
	var first atomic.Bool
	first.Store(true)
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		if first.CompareAndSwap(true, false) {
			<-r.Context().Done() // a connection that dies with the restore
			return
		}
		_, _ = io.WriteString(w, completion)
	})
	r, srv, tok := newTestRelay(t, up.srv.URL)
	got := make(chan []byte, 2)
	go func() {
		_, b := post(t, srv.URL, `{"messages":[]}`)
		got <- b
	}()
	eventually(t, "the call reaches upstream", func() bool { return len(up.seen()) == 1 })
	if _, err := r.Hold(); err != nil {
		t.Fatal(err)
	}
	// The host restores the sandbox: a new attempt, then continue.
	writeCreds(t, tok, Credentials{Episode: "ep", Token: "secret2", Attempt: 1})
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	if b := <-got; string(b) != completion {
		t.Fatalf("after re-issue: %s", b)
	}
	calls := up.seen()
	if len(calls) != 2 || calls[1].callID != "ep/1" || calls[1].attempt != "1" || calls[1].auth != "Bearer secret2" {
		t.Fatalf("upstream calls %+v", calls)
	}
	eventually(t, "the delivery is counted", func() bool { return r.Delivered() == 1 })
	if testutil.ToFloat64(r.m.reissues) != 1 {
		t.Fatalf("reissues %v delivered %d", testutil.ToFloat64(r.m.reissues), r.Delivered())
	}
	select {
	case b := <-got:
		t.Fatalf("a second response reached the harness: %s", b)
	default:
	}
}

// TestReissueToAnotherNodesGateway: the sandbox is resumed in place on
// another node, whose gateway is at another URL, written into the token
// file with the new attempt. The undelivered call is issued again there,
// and so is every later call; the old node's gateway gets nothing more.
// A token file naming an upstream that does not parse moves nothing and
// says so.
func TestReissueToAnotherNodesGateway(t *testing.T) {
	dead := make(chan struct{})
	old := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		select { // the old node dies with the call in flight
		case <-r.Context().Done():
		case <-dead:
			http.Error(w, "gone", http.StatusBadGateway)
		}
	})
	moved := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		_, _ = io.WriteString(w, completion)
	})
	r, srv, tok := newTestRelay(t, old.srv.URL)
	t.Cleanup(func() { close(dead) }) // first: a call left at the old gateway ends
	got := make(chan []byte, 2)
	go func() {
		_, b := post(t, srv.URL, `{"messages":[]}`)
		got <- b
	}()
	eventually(t, "the call reaches the old gateway", func() bool { return len(old.seen()) == 1 })
	if _, err := r.Hold(); err != nil {
		t.Fatal(err)
	}
	writeCreds(t, tok, Credentials{Episode: "ep", Token: "secret", Attempt: 1, Upstream: moved.srv.URL})
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	select {
	case b := <-got:
		if string(b) != completion {
			t.Fatalf("after the move: %s", b)
		}
	case <-time.After(10 * time.Second): // a bound on the wait, not a wait for an event
		t.Fatalf("the re-issued call was not answered in 10 s: it went to %d calls at the old gateway, %d at the new", len(old.seen()), len(moved.seen()))
	}
	if resp, b := post(t, srv.URL, `{"messages":[]}`); resp.StatusCode != 200 || string(b) != completion {
		t.Fatalf("a later call: %d %s", resp.StatusCode, b)
	}
	calls := moved.seen()
	if len(calls) != 2 || calls[0].callID != "ep/1" || calls[0].attempt != "1" || calls[1].callID != "ep/2" {
		t.Fatalf("calls at the new gateway: %+v", calls)
	}
	if n := len(old.seen()); n != 1 {
		t.Fatalf("the old gateway got %d calls, want the first only", n)
	}
	// A bad URL: refused, and the calls stay where they go.
	if _, err := r.Hold(); err != nil {
		t.Fatal(err)
	}
	writeCreds(t, tok, Credentials{Episode: "ep", Token: "secret", Attempt: 1, Upstream: "ftp://elsewhere"})
	if err := r.Release(); err == nil || !strings.Contains(err.Error(), "scheme") {
		t.Fatalf("release with a bad upstream: %v", err)
	}
	if resp, b := post(t, srv.URL, `{"messages":[]}`); resp.StatusCode != 200 || string(b) != completion || len(moved.seen()) != 3 {
		t.Fatalf("after the refused move: %d %s, %d calls at the new gateway", resp.StatusCode, b, len(moved.seen()))
	}
}

// TestUpstreamFailureDuringHoldWaitsForContinue: a restore breaks the
// relay's upstream connection, and until the continue every try fails
// (the gateway is down, or starting again). While held, the failure does
// not reach the harness once the relay's retries are spent: the call
// waits for the continue and is issued again under the new attempt.
func TestUpstreamFailureDuringHoldWaitsForContinue(t *testing.T) {
	fail := make(chan struct{})
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		switch {
		case n == 1:
			<-fail // the old machine's connection, cut by the restore
			c, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				c.Close()
			}
		case r.Header.Get(HeaderAttempt) != "1":
			// Until the continue, every try fails as the first did
			// (more tries than the relay's retries allow).
			c, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				c.Close()
			}
		default:
			_, _ = io.WriteString(w, completion)
		}
	})
	r, srv, tok := newTestRelay(t, up.srv.URL)
	got := make(chan []byte, 2)
	go func() {
		_, b := post(t, srv.URL, `{"messages":[]}`)
		got <- b
	}()
	eventually(t, "the call reaches upstream", func() bool { return len(up.seen()) == 1 })
	if _, err := r.Hold(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Release() }) // a failed test must not leave the call waiting
	close(fail)
	eventually(t, "the relay spends its retries", func() bool { return len(up.seen()) >= 1+r.cfg.Retry.Max })
	eventually(t, "the failed call waits for the continue", func() bool { return testutil.ToFloat64(r.m.held) == 1 })
	select {
	case b := <-got:
		t.Fatalf("the harness saw the failure during the hold: %s", b)
	default:
	}
	writeCreds(t, tok, Credentials{Episode: "ep", Token: "secret2", Attempt: 1})
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	if b := <-got; string(b) != completion {
		t.Fatalf("after the continue: %s", b)
	}
	calls := up.seen()
	if last := calls[len(calls)-1]; last.callID != "ep/1" || last.attempt != "1" || last.auth != "Bearer secret2" {
		t.Fatalf("upstream calls %+v", calls)
	}
}

func TestRetriesBusyUpstreamButNotClientErrors(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		switch {
		case r.Header.Get(HeaderCallID) == "ep/2":
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"bad"}}`)
		case n == 1:
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusTooManyRequests)
		case n == 2:
			w.WriteHeader(http.StatusBadGateway)
		default:
			_, _ = io.WriteString(w, completion)
		}
	})
	r, srv, _ := newTestRelay(t, up.srv.URL)
	resp, b := post(t, srv.URL, `{"messages":[]}`)
	if resp.StatusCode != 200 || string(b) != completion || testutil.ToFloat64(r.m.retries) != 2 {
		t.Fatalf("%d %s retries %v", resp.StatusCode, b, testutil.ToFloat64(r.m.retries))
	}
	resp, b = post(t, srv.URL, `{"messages":[]}`)
	if resp.StatusCode != 400 || !strings.Contains(string(b), `"bad"`) || testutil.ToFloat64(r.m.retries) != 2 {
		t.Fatalf("a 400 was not passed through unchanged: %d %s", resp.StatusCode, b)
	}
}

func TestBadRequests(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) { _, _ = io.WriteString(w, completion) })
	_, srv, _ := newTestRelay(t, up.srv.URL)
	for body, want := range map[string]int{
		`not json`:         400,
		`[1,2]`:            400,
		`{"stream":"yes"}`: 400,
		`{"x":"` + strings.Repeat("a", 1<<17) + `"}`: 413,
	} {
		resp, b := post(t, srv.URL, body)
		if resp.StatusCode != want || !strings.Contains(string(b), `"error"`) {
			t.Errorf("%.30s: %d %s", body, resp.StatusCode, b)
		}
	}
	if n := len(up.seen()); n != 0 {
		t.Fatalf("%d bad requests went upstream", n)
	}
}

func TestUnixUpstream(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "up.sock")
	ln, _, err := serve.Listen("unix:" + sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, completion) })}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	_, rs, _ := newTestRelay(t, "unix://"+sock)
	if resp, b := post(t, rs.URL, `{}`); resp.StatusCode != 200 || string(b) != completion {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}

func FuzzParseSSE(f *testing.F) {
	f.Add([]byte("data: {\"a\":1}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("event: x\ndata: 1\ndata: 2\n\n: comment\n"))
	f.Add([]byte("data:\n\n\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		evs, err := ParseSSE(bytes.NewReader(b))
		if err != nil {
			return
		}
		_, _ = AssembleChat(evs) // must not panic
	})
}

func FuzzParseCall(f *testing.F) {
	f.Add([]byte(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}`))
	f.Add([]byte(`{}`))
	f.Add([]byte(`null`))
	f.Add([]byte(` { "stream" : null , "a" : [1, {"b":"}"}], "stream_options":{"include_usage":true} , "n":-1.5e3 } `))
	f.Add([]byte(`{"a":1,"stream":false}`))
	f.Add([]byte(`{"stream":true}`))
	f.Add([]byte(`{"str\u0065am":true,"x":"\"}"}`))
	f.Add([]byte(`{"stream":1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		checkParseCallFast(t, b)
		up, _, _, err := ParseCall(b)
		if err != nil {
			return
		}
		var o, orig map[string]any
		if json.Unmarshal(up, &o) != nil || o["stream"] != false || o["stream_options"] != nil {
			t.Fatalf("upstream body %s", up)
		}
		// Every other member is unchanged.
		if json.Unmarshal(b, &orig) == nil {
			delete(orig, "stream")
			delete(orig, "stream_options")
			delete(o, "stream")
			if mustJSON(o) != mustJSON(orig) {
				t.Fatalf("members changed:\n%s\n%s", b, up)
			}
		}
	})
}

func FuzzChatChunks(f *testing.F) {
	f.Add([]byte(completion))
	f.Add([]byte(`{"choices":[]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		out, err := ChatChunks(b, true)
		if err != nil {
			return
		}
		if _, err := ParseSSE(bytes.NewReader(out)); err != nil {
			t.Fatalf("chunks do not parse: %v", err)
		}
		if err := ssecheck.CheckChat(out, true); err != nil {
			t.Fatalf("ChatChunks(%s) breaks the chunk format: %v\n%s", b, err, out)
		}
	})
}

// checkParseCallFast holds ParseCall's fast path to the decoder's: where
// it answers, it answers the same, byte for byte.
func checkParseCallFast(t *testing.T, b []byte) {
	t.Helper()
	up, stream, usage, ok := parseCallFast(b)
	if !ok {
		return
	}
	wup, wstream, wusage, err := parseCallJSON(b)
	if err != nil || !bytes.Equal(up, wup) || stream != wstream || usage != wusage {
		t.Fatalf("parseCallFast(%s) = %s %v %v; decoder: %s %v %v %v", b, up, stream, usage, wup, wstream, wusage, err)
	}
}

func TestParseCallFast(t *testing.T) {
	for _, b := range []string{
		`{}`, ` {} `, `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}`,
		`{"stream":false}`, `{"stream":null,"a":1}`, `{"a":1,"stream":true}`, `{"a":{"stream":true},"b":"stream"}`,
		"{\n\t\"stream\" :\r true ,\n \"m\": [ 1 , \"x\\\"y\" ] }", `{"stream":true,"stream":false}`,
		`{"n":1,"stream_options":null,"m":-0.5e-3}`, `{"s":"\\","stream":true}`,
	} {
		if _, _, _, ok := parseCallFast([]byte(b)); !ok {
			t.Errorf("fast path refuses %s", b)
		}
		checkParseCallFast(t, []byte(b))
	}
	for _, b := range []string{`[]`, `not json`, `{"stream":"yes"}`, `{"str\u0065am":true}`, `{} {}`, ``} {
		if _, _, _, ok := parseCallFast([]byte(b)); ok {
			t.Errorf("fast path takes %s", b)
		}
	}
}
