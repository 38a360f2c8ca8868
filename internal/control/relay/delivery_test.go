package relay

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"stasis/internal/storage/ledger"
)

// pipeline is relay → gateway → a model this test controls, as in a
// sandbox, with the episode "ep".
type pipeline struct {
	r     *Relay
	relay *httptest.Server
	g     *Gateway
	model *gatedModel
	tok   string // the relay's token file
	ep    EpisodeState
}

// gatedModel answers chat completions with distinct contents; a call whose
// last user message contains "slow" waits until the test opens the gate.
type gatedModel struct {
	n    atomic.Int64
	gate chan struct{}
	size int // pad each content to this many bytes
	srv  *httptest.Server
	mu   sync.Mutex
	seen []string // request paths
}

func newGatedModel(t *testing.T) *gatedModel {
	m := &gatedModel{gate: make(chan struct{})}
	m.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		m.mu.Lock()
		m.seen = append(m.seen, r.URL.Path)
		m.mu.Unlock()
		if r.URL.Path == "/v1/responses/compact" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			_, _ = io.WriteString(w, `{"error":{"message":"no such endpoint","type":"invalid_request_error","code":"not_found"}}`)
			return
		}
		n := m.n.Add(1)
		if strings.Contains(string(b), "slow") {
			select {
			case <-m.gate:
			case <-r.Context().Done():
				return
			}
		}
		content := fmt.Sprintf("answer %d", n)
		if m.size > len(content) {
			content += strings.Repeat("x", m.size-len(content))
		}
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Path == "/v1/completions" {
			fmt.Fprintf(w, `{"id":"cmpl-%d","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":%q,"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}`, n, content)
			return
		}
		fmt.Fprintf(w, `{"id":"c%d","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}],"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}`, n, content)
	}))
	t.Cleanup(m.srv.Close)
	return m
}

func newPipeline(t *testing.T, heartbeat time.Duration) *pipeline {
	t.Helper()
	return newPipelineWith(t, nil, func(c *Config) { c.Heartbeat = heartbeat })
}

// newPipelineWith is newPipeline with the relay's gateway reached through
// wrap (nil: directly) and the relay's configuration changed by tweak.
func newPipelineWith(t *testing.T, wrap func(http.Handler) http.Handler, tweak func(*Config)) *pipeline {
	t.Helper()
	m := newGatedModel(t)
	g, err := OpenGateway(GatewayConfig{Upstream: m.srv.URL, State: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Close() })
	h := g.Handler()
	if wrap != nil {
		h = wrap(h)
	}
	gsrv := httptest.NewServer(h)
	t.Cleanup(gsrv.Close)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(t.TempDir(), "token.json")
	writeCreds(t, tok, ep.Credentials(0))
	cfg := Config{Upstream: gsrv.URL, TokenFile: tok, SettleDelay: time.Millisecond,
		Retry: Retry{Initial: time.Millisecond, MaxInterval: 5 * time.Millisecond}}
	tweak(&cfg)
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler())
	t.Cleanup(srv.Close)
	return &pipeline{r: r, relay: srv, g: g, model: m, tok: tok, ep: ep}
}

func chatBody(text string, stream bool) string {
	return fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":%q}]}`, stream, text)
}

// callWith posts a chat call with client c; it returns the body or the
// client's error.
func callWith(c *http.Client, base, body string) ([]byte, error) {
	resp, err := c.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return b, err
}

// dispositions reads the ledger's entries' dispositions, in order.
func (p *pipeline) dispositions(t *testing.T) []ledger.Disposition {
	t.Helper()
	h, err := ledger.ReadIn(p.g.Ledgers(), "ep")
	if err != nil {
		t.Fatal(err)
	}
	var out []ledger.Disposition
	for _, e := range h.Entries {
		out = append(out, e.Disposition)
	}
	return out
}

// settled polls until the ledger's dispositions are want (the relay sends
// them after each delivery, on their own or with the next call).
func (p *pipeline) settled(t *testing.T, want ...ledger.Disposition) {
	t.Helper()
	eventually(t, fmt.Sprintf("the ledger's dispositions are %v", want), func() bool {
		return fmt.Sprint(p.dispositions(t)) == fmt.Sprint(want)
	})
}

// TestClientTimesOutDuringHold: a client gives up on a call held by a
// pause and retries it; the call it gave up on never reaches the model,
// and relay_delivered counts exactly the responses the client got.
func TestClientTimesOutDuringHold(t *testing.T) {
	p := newPipeline(t, time.Second)
	if _, err := callWith(http.DefaultClient, p.relay.URL, chatBody("first", false)); err != nil {
		t.Fatal(err)
	}
	if _, err := p.r.Hold(); err != nil {
		t.Fatal(err)
	}
	impatient := &http.Client{Timeout: 300 * time.Millisecond}
	_, err := callWith(impatient, p.relay.URL, chatBody("second", false))
	if err == nil {
		t.Fatal("a call during a hold was answered")
	}
	eventually(t, "the relay sees the client has gone", func() bool { return testutil.ToFloat64(p.r.m.dropped) == 1 })
	// The client retries the same request during the hold: a new call.
	got := make(chan error, 1)
	go func() {
		_, err := callWith(http.DefaultClient, p.relay.URL, chatBody("second", false))
		got <- err
	}()
	eventually(t, "the retry waits on the hold", func() bool { return testutil.ToFloat64(p.r.m.held) == 1 })
	if err := p.r.Release(); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if n := p.model.n.Load(); n != 2 {
		t.Fatalf("the model got %d calls; want 2 (the abandoned call must not be sent)", n)
	}
	held, err := p.r.Hold()
	if err != nil {
		t.Fatal(err)
	}
	if held.Delivered != 2 || held.Position != 2 {
		t.Fatalf("hold after the retry: %+v; the client got 2 responses", held)
	}
	p.settled(t, ledger.Delivered, ledger.Delivered)
	_ = p.r.Release()
}

// TestClientTimesOutAfterTheCallWasSent: the model is slow, the client
// gives up and retries; the first response is recorded but abandoned, the
// retry (a new call id) is delivered, and an in-place cut keeps both.
func TestClientTimesOutAfterTheCallWasSent(t *testing.T) {
	p := newPipeline(t, time.Second)
	if _, err := callWith(http.DefaultClient, p.relay.URL, chatBody("first", false)); err != nil {
		t.Fatal(err)
	}
	impatient := &http.Client{Timeout: 300 * time.Millisecond}
	if _, err := callWith(impatient, p.relay.URL, chatBody("slow one", false)); err == nil {
		t.Fatal("the slow call was answered before the gate opened")
	}
	close(p.model.gate) // the model answers the call the client gave up on
	l, err := p.g.ledger("ep")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the abandoned response is recorded", func() bool { return l.Len() == 2 })
	eventually(t, "and settled as abandoned", func() bool { return testutil.ToFloat64(p.r.m.abandoned) == 1 })
	if _, err := callWith(http.DefaultClient, p.relay.URL, chatBody("slow one", false)); err != nil {
		t.Fatal(err)
	}
	held, err := p.r.Hold()
	if err != nil {
		t.Fatal(err)
	}
	if held.Delivered != 2 || held.Position != 3 {
		t.Fatalf("hold: %+v; want 2 delivered of 3 settled", held)
	}
	p.settled(t, ledger.Delivered, ledger.Abandoned, ledger.Delivered)
	if got := testutil.ToFloat64(p.r.m.delivered); got != 2 {
		t.Fatalf("stasis_relay_delivered_total %v, want 2", got)
	}
	_ = p.r.Release()
	rep, err := ledger.VerifyIn(p.g.Ledgers(), "ep")
	if err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}

// TestClientDisconnectsMidDelivery: a client reads the start of a large
// response and hangs up; the write fails, so the response is abandoned,
// not delivered.
func TestClientDisconnectsMidDelivery(t *testing.T) {
	p := newPipeline(t, time.Second)
	p.model.size = 24 << 20 // more than the socket buffers between relay and client
	conn, err := net.Dial("tcp", strings.TrimPrefix(p.relay.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	body := chatBody("big", false)
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	br := bufio.NewReader(conn)
	line, err := br.ReadString('\n')
	if err != nil || !strings.Contains(line, "200") {
		t.Fatalf("status line %q %v", line, err)
	}
	if _, err := io.ReadFull(br, make([]byte, 64<<10)); err != nil {
		t.Fatal(err)
	}
	conn.(*net.TCPConn).SetLinger(0) // a reset: the relay's next write fails
	conn.Close()
	eventually(t, "the response is settled as abandoned", func() bool { return testutil.ToFloat64(p.r.m.abandoned) == 1 })
	if d := p.r.Delivered(); d != 0 {
		t.Fatalf("delivered %d for a response the client hung up on", d)
	}
	if testutil.ToFloat64(p.r.m.delivered) != 0 {
		t.Fatal("stasis_relay_delivered_total counted a failed write")
	}
	p.settled(t, ledger.Abandoned)
}

// streamClient reads an SSE response with a first-byte and idle timeout
// shorter than the wait for the model: each read must see a byte within
// idle, or it fails as such clients do.
func streamClient(ctx context.Context, base, body string, idle time.Duration) (string, error) {
	d := net.Dialer{}
	conn, err := d.DialContext(ctx, "tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
	var out strings.Builder
	buf := make([]byte, 4096)
	for {
		_ = conn.SetReadDeadline(time.Now().Add(idle))
		n, err := conn.Read(buf)
		out.Write(buf[:n])
		if errors.Is(err, io.EOF) || strings.Contains(out.String(), "data: [DONE]") {
			return out.String(), nil
		}
		if err != nil {
			return out.String(), fmt.Errorf("after %d bytes: %w", out.Len(), err)
		}
	}
}

// TestStreamingClientTimeoutShorterThanGenerationAndHold: the client
// needs a byte within 400ms, the model takes longer and a hold longer
// still; headers and heartbeats keep it alive, and it gets the stream.
func TestStreamingClientTimeoutShorterThanGenerationAndHold(t *testing.T) {
	p := newPipeline(t, 100*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type answer struct {
		s   string
		err error
	}
	got := make(chan answer, 1)
	go func() {
		s, err := streamClient(ctx, p.relay.URL, chatBody("slow stream", true), 400*time.Millisecond)
		got <- answer{s, err}
	}()
	eventually(t, "the call reaches the model", func() bool { return p.model.n.Load() == 1 })
	// The generation outlasts the client's timeout (heartbeats keep it
	// alive), then a hold does too.
	eventually(t, "heartbeats while the model generates", func() bool { return testutil.ToFloat64(p.r.m.heartbeats) >= 8 })
	if _, err := p.r.Hold(); err != nil {
		t.Fatal(err)
	}
	close(p.model.gate)
	eventually(t, "the response waits on the hold", func() bool { return testutil.ToFloat64(p.r.m.held) == 1 })
	beats := testutil.ToFloat64(p.r.m.heartbeats)
	eventually(t, "heartbeats during the hold", func() bool { return testutil.ToFloat64(p.r.m.heartbeats) >= beats+8 })
	if err := p.r.Release(); err != nil {
		t.Fatal(err)
	}
	a := <-got
	if a.err != nil {
		t.Fatalf("client: %v\n%s", a.err, a.s)
	}
	if !strings.Contains(a.s, "text/event-stream") || !strings.Contains(a.s, ": keep-alive") || !strings.Contains(a.s, `"answer 1"`) {
		t.Fatalf("stream:\n%s", a.s)
	}
	eventually(t, "the delivery is counted", func() bool { return p.r.Delivered() == 1 })
}

// TestUpstreamFailureAfterHeadersIsAnErrorEvent: a streaming client has
// its headers already when the upstream fails; it gets the format's error
// event, and nothing counts as delivered.
func TestUpstreamFailureAfterHeadersIsAnErrorEvent(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":{"message":"context length exceeded","type":"invalid_request_error","code":"context_length_exceeded"}}`)
	})
	r, srv, _ := newTestRelay(t, up.srv.URL)
	for _, path := range []string{"/v1/chat/completions", "/v1/responses"} {
		resp, err := http.Post(srv.URL+path, "application/json", strings.NewReader(`{"stream":true,"input":"x","messages":[]}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" || !strings.Contains(string(b), "context length exceeded") {
			t.Fatalf("%s: %d %q\n%s", path, resp.StatusCode, resp.Header.Get("Content-Type"), b)
		}
	}
	if r.Delivered() != 0 {
		t.Fatalf("delivered %d", r.Delivered())
	}
}

// TestPathsClientsUse: base URLs with and without /v1; other model
// endpoints are relayed and recorded; a refusal upstream is passed
// through; the models list is not recorded.
func TestPathsClientsUse(t *testing.T) {
	p := newPipeline(t, time.Second)
	for _, path := range []string{"/chat/completions", "/v1/chat/completions"} {
		resp, err := http.Post(p.relay.URL+path, "application/json", strings.NewReader(chatBody(path, false)))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), "chat.completion") {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
		}
	}
	// A legacy completion, streamed: relayed, recorded and re-chunked.
	resp, err := http.Post(p.relay.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"text":"answer 3"`) || !strings.Contains(string(b), `"total_tokens":5`) || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		t.Fatalf("completions stream: %d\n%s", resp.StatusCode, b)
	}
	// An endpoint the model refuses: its answer, not the relay's 404.
	resp, err = http.Post(p.relay.URL+"/v1/responses/compact", "application/json", strings.NewReader(`{"model":"m","input":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 404 || !strings.Contains(string(b), "no such endpoint") {
		t.Fatalf("compact: %d %s", resp.StatusCode, b)
	}
	// Asking a stream of an endpoint the relay cannot re-chunk is refused,
	// and nothing goes upstream.
	before := len(p.model.seen)
	resp, err = http.Post(p.relay.URL+"/v1/embeddings", "application/json", strings.NewReader(`{"model":"m","input":"x","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 400 || len(p.model.seen) != before {
		t.Fatalf("embeddings with stream: %d, upstream calls %d → %d", resp.StatusCode, before, len(p.model.seen))
	}
	for _, path := range []string{"/models", "/v1/models"} {
		resp, err := http.Get(p.relay.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	h, err := ledger.ReadIn(p.g.Ledgers(), "ep")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range h.Entries {
		var req map[string]any
		_ = json.Unmarshal(e.Request, &req)
		got = append(got, fmt.Sprintf("%v %v", req["prompt"], req["messages"] != nil))
	}
	if len(h.Entries) != 3 || got[2] != "hi false" {
		t.Fatalf("ledger entries: %v", got)
	}
}

// TestAnswerNoCallReadIsSettledAbandoned: the gateway records call 2's
// answer, but the connection breaks before the relay reads it, on every
// try, and the call fails. The entry is not left as a gap that the next
// call would wait behind forever: once no call is with the upstream, it
// is settled as abandoned and the next call is delivered.
func TestAnswerNoCallReadIsSettledAbandoned(t *testing.T) {
	var cut atomic.Int64
	p := newPipelineWith(t, func(gw http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
			if q.Header.Get(HeaderCallID) != "ep/2" {
				gw.ServeHTTP(w, q)
				return
			}
			// The gateway answers (and records); the relay never reads it.
			gw.ServeHTTP(httptest.NewRecorder(), q)
			cut.Add(1)
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close()
			}
		})
	}, func(c *Config) { c.Retry = Retry{Max: 3, Initial: time.Millisecond, MaxInterval: 2 * time.Millisecond} })
	r, srv := p.r, p.relay
	if _, err := callWith(http.DefaultClient, srv.URL, chatBody("one", false)); err != nil {
		t.Fatal(err)
	}
	if _, err := callWith(http.DefaultClient, srv.URL, chatBody("two", false)); err == nil || !strings.Contains(err.Error(), "502") {
		t.Fatalf("call 2: %v; want the relay's 502", err)
	}
	if cut.Load() != 4 {
		t.Fatalf("call 2 was tried %d times, want 4", cut.Load())
	}
	got := make(chan error, 1)
	go func() {
		_, err := callWith(http.DefaultClient, srv.URL, chatBody("three", false))
		got <- err
	}()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		// Unstick the waiting call (a raised attempt makes it issue again,
		// and the gateway refuses the unknown attempt), so the test ends.
		writeCreds(t, p.tok, Credentials{Episode: "ep", Token: p.ep.Token, Attempt: 99})
		_ = r.Release()
		<-got
		t.Fatal("call 3 waited behind an entry no call will read")
	}
	held, err := r.Hold()
	if err != nil || held.Delivered != 2 || held.Position != 3 {
		t.Fatalf("hold: %+v %v; want 2 delivered, position 3", held, err)
	}
	p.settled(t, ledger.Delivered, ledger.Abandoned, ledger.Delivered)
}

// TestOrphanSkippedWhenTheLastCallComesBack: entry 2 is an answer no call
// read (call 2 failed); call 3's answer waits behind it while call 4 is
// still with the upstream, so the gap cannot be skipped yet. When call 4
// comes back, no call is with the upstream any more: the gap is settled as
// abandoned and both calls are delivered, rather than each waiting for the
// other.
func TestOrphanSkippedWhenTheLastCallComesBack(t *testing.T) {
	cutTwo, holdFour := make(chan struct{}), make(chan struct{})
	var fourSeen atomic.Bool
	p := newPipelineWith(t, func(gw http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
			switch q.Header.Get(HeaderCallID) {
			case "ep/2":
				// The gateway answers (and records); the relay never reads it.
				gw.ServeHTTP(httptest.NewRecorder(), q)
				<-cutTwo
				if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
					conn.Close()
				}
			case "ep/4":
				fourSeen.Store(true)
				<-holdFour
				gw.ServeHTTP(w, q)
			default:
				gw.ServeHTTP(w, q)
			}
		})
	}, func(c *Config) { c.Retry = Retry{Max: 1, Initial: time.Millisecond, MaxInterval: 2 * time.Millisecond} })
	if _, err := callWith(http.DefaultClient, p.relay.URL, chatBody("one", false)); err != nil {
		t.Fatal(err)
	}
	l, err := p.g.ledger("ep")
	if err != nil {
		t.Fatal(err)
	}
	call := func(text string) chan error {
		got := make(chan error, 1)
		go func() {
			_, err := callWith(http.DefaultClient, p.relay.URL, chatBody(text, false))
			got <- err
		}()
		return got
	}
	two := call("two")
	eventually(t, "call 2's answer is recorded", func() bool { return l.Len() == 2 })
	three := call("three")
	eventually(t, "call 3's answer waits behind entry 2", func() bool { return l.Len() == 3 && testutil.ToFloat64(p.r.m.held) == 1 })
	four := call("four")
	eventually(t, "call 4 is with the upstream", fourSeen.Load)
	close(cutTwo)
	if err := <-two; err == nil || !strings.Contains(err.Error(), "502") {
		t.Fatalf("call 2: %v; want the relay's 502", err)
	}
	close(holdFour)
	for i, got := range []chan error{three, four} {
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("call %d: %v", i+3, err)
			}
		case <-time.After(20 * time.Second):
			// Unstick the waiting calls (a raised attempt makes them issue
			// again, and the gateway refuses the unknown attempt).
			writeCreds(t, p.tok, Credentials{Episode: "ep", Token: p.ep.Token, Attempt: 99})
			_ = p.r.Release()
			t.Fatalf("call %d waited behind an entry no call will read", i+3)
		}
	}
	held, err := p.r.Hold()
	if err != nil || held.Delivered != 3 || held.Position != 4 {
		t.Fatalf("hold: %+v %v; want 3 delivered, position 4", held, err)
	}
	p.settled(t, ledger.Delivered, ledger.Abandoned, ledger.Delivered, ledger.Delivered)
}
