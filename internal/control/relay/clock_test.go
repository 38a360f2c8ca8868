package relay

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"stasis/internal/storage/ledger"
)

// fakeClock is a Clock the test moves by hand: a timer fires, in its own
// goroutine as the system's do, when Advance passes its time.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	at time.Time
	f  func()
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{at: c.now.Add(d), f: f}
	if d <= 0 {
		go f()
		return func() bool { return false }
	}
	c.timers = append(c.timers, t)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		i := slices.Index(c.timers, t)
		if i < 0 {
			return false
		}
		c.timers = slices.Delete(c.timers, i, i+1)
		return true
	}
}

// Advance moves the clock on by d, firing the timers due by then, soonest
// first.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	until := c.now.Add(d)
	for {
		i := -1
		for j, t := range c.timers {
			if !t.at.After(until) && (i < 0 || t.at.Before(c.timers[i].at)) {
				i = j
			}
		}
		if i < 0 {
			break
		}
		t := c.timers[i]
		c.timers = slices.Delete(c.timers, i, i+1)
		c.now = t.at
		go t.f()
	}
	c.now = until
}

// Waiting lists the time left on each timer not fired yet, soonest first.
func (c *fakeClock) Waiting() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []time.Duration
	for _, t := range c.timers {
		out = append(out, t.at.Sub(c.now))
	}
	slices.Sort(out)
	return out
}

// waitingFor polls until the clock's pending timers are want.
func (c *fakeClock) waitingFor(t *testing.T, what string, want ...time.Duration) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s (timers %v)", what, want), func() bool { return slices.Equal(c.Waiting(), want) })
}

// TestHeartbeatsFollowTheClock: a streaming client waiting for a slow
// model gets one comment each time the clock passes the heartbeat, and
// none before.
func TestHeartbeatsFollowTheClock(t *testing.T) {
	clock := newFakeClock()
	const beat = 5 * time.Second
	p := newPipelineWith(t, nil, func(c *Config) { c.Heartbeat, c.Clock = beat, clock })
	type answer struct {
		body string
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		resp, err := http.Post(p.relay.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("slow", true)))
		if err != nil {
			got <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		got <- answer{string(b), err}
	}()
	eventually(t, "the call reaches the model", func() bool { return p.model.n.Load() == 1 })
	for beats := 1; beats <= 3; beats++ {
		clock.waitingFor(t, "the heartbeat is the one timer", beat)
		clock.Advance(beat - time.Millisecond)
		if n := testutil.ToFloat64(p.r.m.heartbeats); n != float64(beats-1) {
			t.Fatalf("%v heartbeats before the clock reached the %d. beat", n, beats)
		}
		clock.Advance(time.Millisecond)
		eventually(t, fmt.Sprintf("heartbeat %d", beats), func() bool { return testutil.ToFloat64(p.r.m.heartbeats) == float64(beats) })
	}
	close(p.model.gate)
	a := <-got
	if a.err != nil || strings.Count(a.body, ": keep-alive") != 3 || !strings.Contains(a.body, `"answer 1"`) {
		t.Fatalf("stream (%v):\n%s", a.err, a.body)
	}
}

// TestRetryAfterIsWaitedOnTheClock: an upstream 429 with Retry-After: 30
// is tried again when the clock has moved 30 seconds, not before.
func TestRetryAfterIsWaitedOnTheClock(t *testing.T) {
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, n int) {
		if n == 1 {
			w.Header().Set("Retry-After", "30")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		_, _ = io.WriteString(w, completion)
	})
	clock := newFakeClock()
	tok := filepath.Join(t.TempDir(), "token.json")
	writeCreds(t, tok, Credentials{Episode: "ep", Token: "secret"})
	r, err := New(Config{Upstream: up.srv.URL, TokenFile: tok, Clock: clock, Retry: Retry{Initial: time.Second, MaxInterval: 10 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler())
	t.Cleanup(srv.Close)
	got := make(chan string, 1)
	go func() {
		_, b := post(t, srv.URL, `{"messages":[]}`)
		got <- string(b)
	}()
	clock.waitingFor(t, "the relay waits out the Retry-After", 30*time.Second)
	clock.Advance(29 * time.Second)
	if n := len(up.seen()); n != 1 {
		t.Fatalf("%d upstream calls 29s into a 30s Retry-After", n)
	}
	clock.Advance(time.Second)
	if b := <-got; b != completion {
		t.Fatalf("after the retry: %s", b)
	}
	if n, retries := len(up.seen()), testutil.ToFloat64(r.m.retries); n != 2 || retries != 1 {
		t.Fatalf("%d upstream calls, %v retries; want 2 and 1", n, retries)
	}
}

// TestSettlementWaitsForTheDelayOrTheNextCall: a delivery's settlement is
// sent on its own once the clock passes SettleDelay, unless the next call
// takes it first.
func TestSettlementWaitsForTheDelayOrTheNextCall(t *testing.T) {
	clock := newFakeClock()
	const delay = 50 * time.Millisecond
	p := newPipelineWith(t, nil, func(c *Config) { c.SettleDelay, c.Clock = delay, clock })
	if _, err := callWith(http.DefaultClient, p.relay.URL, chatBody("one", false)); err != nil {
		t.Fatal(err)
	}
	clock.waitingFor(t, "the settlement waits for its flush", delay)
	if got := p.dispositions(t); fmt.Sprint(got) != fmt.Sprint([]ledger.Disposition{ledger.Pending}) {
		t.Fatalf("dispositions %v before the flush", got)
	}
	clock.Advance(delay)
	p.settled(t, ledger.Delivered)

	// The next settlement rides on the call after it.
	if _, err := callWith(http.DefaultClient, p.relay.URL, chatBody("two", false)); err != nil {
		t.Fatal(err)
	}
	clock.waitingFor(t, "the settlement waits for its flush", delay)
	if _, err := callWith(http.DefaultClient, p.relay.URL, chatBody("three", false)); err != nil {
		t.Fatal(err)
	}
	p.settled(t, ledger.Delivered, ledger.Delivered, ledger.Pending)
	// The ledger shows the third entry pending once the gateway has it; the
	// relay queues its settlement only when the delivery is done, which may
	// be later: the clock moves on after that.
	eventually(t, "the relay has settled the third delivery", func() bool { return testutil.ToFloat64(p.r.m.delivered) == 3 })
	clock.Advance(delay)
	p.settled(t, ledger.Delivered, ledger.Delivered, ledger.Delivered)
}

// TestGatewayStampsFromItsClock: an episode's creation and a ledger
// entry's start and finish are read from the gateway's clock.
func TestGatewayStampsFromItsClock(t *testing.T) {
	model := newFakeModel(t)
	clock := newFakeClock()
	g, err := OpenGateway(GatewayConfig{Upstream: model.srv.URL, State: t.TempDir(), Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Close() })
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(srv.Close)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	if !ep.Created.Equal(clock.Now()) {
		t.Fatalf("created %v, clock %v", ep.Created, clock.Now())
	}
	clock.Advance(time.Hour)
	if resp, b := gwCall(t, srv.URL, ep.Token, 0, "ep/1", `{"messages":[]}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	l, err := g.ledger("ep")
	if err != nil {
		t.Fatal(err)
	}
	e := l.Entries()[0]
	if !e.Started.Equal(clock.Now()) || !e.Finished.Equal(clock.Now()) {
		t.Fatalf("entry started %v, finished %v; clock %v", e.Started, e.Finished, clock.Now())
	}
}
