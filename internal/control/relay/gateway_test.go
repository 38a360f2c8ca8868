package relay

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"stasis/errdefs"
	"stasis/internal/storage/ledger"
)

// fakeModel answers every chat call with a completion whose content counts
// the calls, so each response is distinct.
type fakeModel struct {
	n     atomic.Int64
	block chan struct{} // when set, calls wait on it
	srv   *httptest.Server
}

func newFakeModel(t *testing.T) *fakeModel {
	m := &fakeModel{}
	m.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := m.n.Add(1)
		if m.block != nil {
			select {
			case <-m.block:
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c%d","object":"chat.completion","prompt_token_ids":[1,2],"choices":[{"index":0,"message":{"role":"assistant","content":"answer %d"},"finish_reason":"stop","token_ids":[7,8,9]}],"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}`, n, n)
	}))
	t.Cleanup(m.srv.Close)
	return m
}

func newTestGateway(t *testing.T, model string) (*Gateway, *httptest.Server) {
	t.Helper()
	g, err := OpenGateway(GatewayConfig{Upstream: model, State: t.TempDir(), MaxBody: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Close() })
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(srv.Close)
	return g, srv
}

// restartGateway closes g and opens a gateway over its state, as after a
// restart: the episodes are known, their ledgers not yet open.
func restartGateway(t *testing.T, g *Gateway) (*Gateway, *httptest.Server) {
	t.Helper()
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	g2, err := OpenGateway(g.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g2.Close() })
	srv := httptest.NewServer(g2.Handler())
	t.Cleanup(srv.Close)
	return g2, srv
}

func gwCall(t *testing.T, url, token string, attempt int, callID, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set(HeaderAttempt, fmt.Sprint(attempt))
	req.Header.Set(HeaderCallID, callID)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func TestGatewayRefusesAndRecords(t *testing.T) {
	model := newFakeModel(t)
	g, srv := newTestGateway(t, model.srv.URL)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.AddEpisode("../x"); err == nil {
		t.Fatal("a path as an episode name was accepted")
	}
	cases := []struct {
		token   string
		attempt int
		call    string
		body    string
		want    int
	}{
		{"wrong", 0, "ep/1", `{}`, 401},
		{ep.Token, 1, "ep/1", `{}`, 409},
		{ep.Token, 0, "other/1", `{}`, 400},
		{ep.Token, 0, "ep/1", `nope`, 400},
		{ep.Token, 0, "ep/1", `{"x":"` + strings.Repeat("a", 1<<17) + `"}`, 413},
	}
	for _, c := range cases {
		resp, b := gwCall(t, srv.URL, c.token, c.attempt, c.call, c.body)
		if resp.StatusCode != c.want || !strings.Contains(string(b), `"error"`) {
			t.Errorf("%+v: %d %s", c, resp.StatusCode, b)
		}
	}
	if model.n.Load() != 0 {
		t.Fatal("a refused call reached the model")
	}
	_, written0 := ledger.Flushes()
	resp, b := gwCall(t, srv.URL, ep.Token, 0, "ep/1", `{"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(HeaderLedgerSeq) != "1" || !strings.Contains(string(b), "answer 1") {
		t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, b)
	}
	// The append was flushed, and the metrics say so.
	if _, written := ledger.Flushes(); written <= written0 {
		t.Fatalf("flushed ledger writes %d before the call, %d after", written0, written)
	}
	mr, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(mr.Body)
	mr.Body.Close()
	for _, name := range []string{"stasis_gateway_ledger_flushes_total ", "stasis_gateway_ledger_flushed_writes_total "} {
		if !strings.Contains(string(metrics), "\n"+name) {
			t.Errorf("/metrics has no %s", name)
		}
	}
	// Dedupe: the same call again is answered from the ledger.
	resp, b2 := gwCall(t, srv.URL, ep.Token, 0, "ep/1", `{ "messages": [{"role":"user","content":"hi"}] }`)
	if resp.StatusCode != 200 || string(b2) != string(b) || model.n.Load() != 1 || testutil.ToFloat64(g.m.dedupe) != 1 {
		t.Fatalf("dedupe: %d %s, model calls %d", resp.StatusCode, b2, model.n.Load())
	}
	// The same call id with another request is a conflict, not a dedupe.
	if resp, _ := gwCall(t, srv.URL, ep.Token, 0, "ep/1", `{"messages":[]}`); resp.StatusCode != 409 {
		t.Fatalf("reused call id: %d", resp.StatusCode)
	}
	l, err := g.ledger("ep")
	if err != nil {
		t.Fatal(err)
	}
	es := l.Entries()
	if len(es) != 1 || es[0].CallID != "ep/1" || es[0].Tokens == nil || len(es[0].Tokens.CompletionIDs) != 3 {
		t.Fatalf("ledger %+v", es)
	}
}

// TestRelayAndGatewayRestoreInPlace: a call completes upstream during a
// hold and is not delivered; the sandbox is restored (ledger cut to the
// relay's deliveries, attempt raised); the relay issues it again; the
// harness gets one response per call and the ledger holds each once.
func TestRelayAndGatewayRestoreInPlace(t *testing.T) {
	model := newFakeModel(t)
	g, gsrv := newTestGateway(t, model.srv.URL)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(t.TempDir(), "token.json")
	writeCreds(t, tok, ep.Credentials(0))
	r, err := New(Config{Upstream: gsrv.URL, TokenFile: tok})
	if err != nil {
		t.Fatal(err)
	}
	rsrv := httptest.NewServer(r.Handler())
	defer rsrv.Close()

	if _, b := post(t, rsrv.URL, `{"messages":[{"role":"user","content":"1"}]}`); !strings.Contains(string(b), "answer 1") {
		t.Fatalf("first call: %s", b)
	}
	model.block = make(chan struct{})
	got := make(chan []byte, 2)
	go func() {
		_, b := post(t, rsrv.URL, `{"messages":[{"role":"user","content":"1"},{"role":"assistant","content":"answer 1"},{"role":"user","content":"2"}]}`)
		got <- b
	}()
	eventually(t, "call 2 reaches the model", func() bool { return model.n.Load() == 2 })
	held, err := r.Hold()
	if err != nil || held.Delivered != 1 || held.Position != 1 {
		t.Fatalf("hold: %+v %v", held, err)
	}
	close(model.block) // call 2 completes and is recorded, but held
	l, _ := g.ledger("ep")
	eventually(t, "call 2 is in the ledger", func() bool { return l.Len() == 2 })
	// Restore in place: cut to relay_delivered, next attempt, continue.
	st, err := g.Restore("ep", true, LedgerAt{Position: held.Position})
	if err != nil || st.Attempt != 1 || l.Len() != 1 {
		t.Fatalf("restore: %+v %v, ledger %d", st, err, l.Len())
	}
	writeCreds(t, tok, st.Credentials(0))
	model.block = nil
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	b := <-got
	if !strings.Contains(string(b), "answer") {
		t.Fatalf("after restore: %s", b)
	}
	es := l.Entries()
	if len(es) != 2 || es[1].CallID != "ep/2" || es[1].Attempt != 1 || !strings.Contains(string(es[1].Response), strings.TrimSpace(strings.Split(string(b), `"content":"`)[1][:8])) {
		t.Fatalf("ledger after restore: %+v\nharness got %s", es, b)
	}
	eventually(t, "the delivery is counted", func() bool { return r.Delivered() == 2 })
	// An old-attempt call is now refused.
	if resp, _ := gwCall(t, gsrv.URL, ep.Token, 0, "ep/9", `{}`); resp.StatusCode != 409 {
		t.Fatalf("stale attempt after restore: %d", resp.StatusCode)
	}
	if rep, err := ledger.VerifyIn(g.Ledgers(), "ep"); err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}

func TestRelaunchMatchesTheLedger(t *testing.T) {
	model := newFakeModel(t)
	g, srv := newTestGateway(t, model.srv.URL)
	ep, _ := g.AddEpisode("ep")
	conv := `{"role":"user","content":"task"}`
	for i := 1; i <= 3; i++ {
		resp, b := gwCall(t, srv.URL, ep.Token, 0, fmt.Sprintf("ep/%d", i), `{"messages":[`+conv+`]}`)
		if resp.StatusCode != 200 {
			t.Fatal(string(b))
		}
		conv += fmt.Sprintf(`,{"role":"assistant","content":"answer %d"},{"role":"user","content":"more"}`, i)
	}
	// The harness is relaunched from a session that saw two answers.
	st, err := g.Restore("ep", false, LedgerAt{Position: 0})
	if err != nil || !st.NeedMatch {
		t.Fatal(st, err)
	}
	two := `{"role":"user","content":"task"},{"role":"assistant","content":"answer 1"},{"role":"user","content":"more"},{"role":"assistant","content":"answer 2"},{"role":"user","content":"more"}`
	resp, b := gwCall(t, srv.URL, st.Token, 1, "ep/3", `{"messages":[`+two+`]}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	l, _ := g.ledger("ep")
	es := l.Entries()
	if len(es) != 3 || !es[2].Boundary || es[2].Attempt != 1 || strings.Contains(string(es[2].Response), "answer 3") {
		t.Fatalf("ledger after relaunch: %d entries, last %+v", len(es), es[len(es)-1])
	}
	if broken, _ := l.Broken(); broken {
		t.Fatal("a matching relaunch marked the history broken")
	}
	// A relaunch whose conversation matches nothing marks it broken.
	st, _ = g.Restore("ep", false, LedgerAt{Position: 0})
	if resp, _ := gwCall(t, srv.URL, st.Token, 2, "ep/4", `{"messages":[{"role":"user","content":"task"},{"role":"assistant","content":"never said"}]}`); resp.StatusCode != 200 {
		t.Fatalf("%d", resp.StatusCode)
	}
	if broken, why := l.Broken(); !broken {
		t.Fatal("a mismatching relaunch did not mark the history broken")
	} else {
		t.Logf("broken: %s", why)
	}
}

func TestConcurrentDuplicatesCallTheModelOnce(t *testing.T) {
	model := newFakeModel(t)
	model.block = make(chan struct{})
	g, srv := newTestGateway(t, model.srv.URL)
	ep, _ := g.AddEpisode("ep")
	var wg sync.WaitGroup
	bodies := make([]string, 4)
	for i := range bodies {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			_, b := gwCall(t, srv.URL, ep.Token, 0, "ep/1", `{"messages":[]}`)
			bodies[i] = string(b)
		}(i)
	}
	eventually(t, "the first reaches the model", func() bool { return model.n.Load() == 1 })
	close(model.block)
	wg.Wait()
	for _, b := range bodies {
		if b != bodies[0] || !strings.Contains(b, "answer 1") {
			t.Fatalf("answers differ: %q", bodies)
		}
	}
	if model.n.Load() != 1 {
		t.Fatalf("model called %d times", model.n.Load())
	}
	var m map[string]any
	_ = json.Unmarshal([]byte(bodies[0]), &m)
}

// The first calls of many episodes arrive together after a restart: each
// episode's ledger is opened once (a second Open would fail: the ledger is
// locked), the opens do not wait on one another, and every call is
// recorded.
func TestFirstCallsOfManyEpisodesAtOnce(t *testing.T) {
	model := newFakeModel(t)
	g, _ := newTestGateway(t, model.srv.URL)
	const episodes, callsEach = 16, 3
	eps := make([]EpisodeState, episodes)
	for i := range eps {
		var err error
		if eps[i], err = g.AddEpisode(fmt.Sprintf("ep%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	g, srv := restartGateway(t, g)
	var wg sync.WaitGroup
	for i := range episodes {
		for c := 1; c <= callsEach; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, b := gwCall(t, srv.URL, eps[i].Token, 0, fmt.Sprintf("ep%d/%d", i, c), `{"messages":[]}`)
				if resp.StatusCode != 200 {
					t.Errorf("ep%d/%d: %d %s", i, c, resp.StatusCode, b)
				}
			}()
		}
	}
	wg.Wait()
	for i := range episodes {
		l, err := g.ledger(fmt.Sprintf("ep%d", i))
		if err != nil || l.Len() != callsEach {
			t.Fatalf("ep%d: %v, %d entries", i, err, l.Len())
		}
	}
	// Many goroutines asking for one ledger at once get the same one.
	var mu sync.Mutex
	seen := map[*ledger.Ledger]bool{}
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := g.ledger("fresh")
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			seen[l] = true
			mu.Unlock()
		}()
	}
	wg.Wait()
	if len(seen) != 1 {
		t.Fatalf("%d ledgers opened for one episode", len(seen))
	}
}

// A ledger that cannot be opened fails each call that needs it, every
// time, and does not leave later calls waiting for the failed open.
func TestLedgerThatWillNotOpen(t *testing.T) {
	model := newFakeModel(t)
	g, _ := newTestGateway(t, model.srv.URL)
	ep, _ := g.AddEpisode("ep")
	g, srv := restartGateway(t, g)
	if err := os.WriteFile(filepath.Join(ledger.Dir(g.Ledgers()), "ep.ledger"), []byte("not a ledger\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for c := 1; c <= 2; c++ {
		resp, b := gwCall(t, srv.URL, ep.Token, 0, fmt.Sprintf("ep/%d", c), `{"messages":[]}`)
		if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(string(b), "damaged") {
			t.Fatalf("call %d: %d %s", c, resp.StatusCode, b)
		}
	}
	if model.n.Load() != 0 {
		t.Fatalf("the model was called %d times", model.n.Load())
	}
}

// AddEpisode opens the episode's ledger (its first call does not create
// it), and refuses an episode whose ledger cannot be opened.
func TestAddEpisodeOpensItsLedger(t *testing.T) {
	model := newFakeModel(t)
	g, _ := newTestGateway(t, model.srv.URL)
	if _, err := g.AddEpisode("ep"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(ledger.Dir(g.Ledgers()), "ep.ledger")); err != nil {
		t.Fatalf("no ledger file after AddEpisode: %v", err)
	}
	g.mu.Lock()
	_, open := g.ledgers["ep"]
	g.mu.Unlock()
	if !open {
		t.Fatal("the ledger is not open after AddEpisode")
	}
	if err := os.WriteFile(filepath.Join(ledger.Dir(g.Ledgers()), "bad.ledger"), []byte("not a ledger\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := g.AddEpisode("bad"); err == nil || !strings.Contains(err.Error(), "damaged") {
		t.Fatalf("AddEpisode over a damaged ledger: %v", err)
	}
	if _, err := g.Episode("bad"); !errors.Is(err, ErrUnknownEpisode) {
		t.Fatalf("the refused episode is registered: %v", err)
	}
}

// TestRestoreInPlaceRefusesALedgerThatMovedOn: checkpoint B is taken after
// two calls, the episode is restored to an earlier checkpoint A (one call)
// and makes a new second call; restoring B in place then finds the
// ledger's entry 2 is not the one B's harness received and refuses,
// cutting nothing. The right head restores.
func TestRestoreInPlaceRefusesALedgerThatMovedOn(t *testing.T) {
	model := newFakeModel(t)
	g, srv := newTestGateway(t, model.srv.URL)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	call := func(attempt int, n int) {
		t.Helper()
		resp, b := gwCall(t, srv.URL, ep.Token, attempt, fmt.Sprintf("ep/%d", n), fmt.Sprintf(`{"messages":[{"role":"user","content":"%d at attempt %d"}]}`, n, attempt))
		if resp.StatusCode != 200 {
			t.Fatalf("call %d at attempt %d: %d %s", n, attempt, resp.StatusCode, b)
		}
	}
	call(0, 1)
	headA, err := g.Head("ep", 1)
	if err != nil || headA == "" {
		t.Fatalf("head at 1: %q %v", headA, err)
	}
	call(0, 2)
	headB, err := g.Head("ep", 2)
	if err != nil || headB == "" || headB == headA {
		t.Fatalf("head at 2: %q %v", headB, err)
	}
	if h, err := g.Head("ep", 0); err != nil || h != "" {
		t.Fatalf("head at 0: %q %v", h, err)
	}
	if _, err := g.Head("ep", 3); err == nil {
		t.Fatal("a head past the ledger's end")
	}
	// Restore A in place; the episode then makes another second call.
	if _, err := g.Restore("ep", true, LedgerAt{Position: 1, Head: headA}); err != nil {
		t.Fatal(err)
	}
	call(1, 2)
	l, _ := g.ledger("ep")
	before := l.Entries()
	if len(before) != 2 {
		t.Fatalf("ledger of %d entries", len(before))
	}
	// Restore B in place: refused, nothing changed.
	_, err = g.Restore("ep", true, LedgerAt{Position: 2, Head: headB})
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "moved on") {
		t.Fatalf("restore of B onto the moved-on ledger: %v", err)
	}
	after := l.Entries()
	if len(after) != 2 || after[1].Hash != before[1].Hash {
		t.Fatalf("the refused restore changed the ledger: %+v", after)
	}
	if st, _ := g.Episode("ep"); st.Attempt != 1 {
		t.Fatalf("the refused restore raised the attempt to %d", st.Attempt)
	}
	// With the head the ledger does hold, the restore goes ahead.
	cur, _ := g.Head("ep", 2)
	if st, err := g.Restore("ep", true, LedgerAt{Position: 2, Head: cur}); err != nil || st.Attempt != 2 {
		t.Fatalf("restore with the current head: %+v %v", st, err)
	}
}

// TestRestoreBranchesBackToACheckpointsTip: as above, but the checkpoints
// recorded their ledger tips: restoring B after A's history moved on
// branches the ledger back to B's tip and resumes in place; A's later
// history stays readable, a copy of B can be forked from B's tip, and
// restoring A's later checkpoint C goes back there again.
func TestRestoreBranchesBackToACheckpointsTip(t *testing.T) {
	model := newFakeModel(t)
	g, srv := newTestGateway(t, model.srv.URL)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	call := func(attempt, n int) {
		t.Helper()
		resp, b := gwCall(t, srv.URL, ep.Token, attempt, fmt.Sprintf("ep/%d", n), fmt.Sprintf(`{"messages":[{"role":"user","content":"%d at attempt %d"}]}`, n, attempt))
		if resp.StatusCode != 200 {
			t.Fatalf("call %d at attempt %d: %d %s", n, attempt, resp.StatusCode, b)
		}
	}
	checkpoint := func(position int64) LedgerAt {
		t.Helper()
		head, err := g.Head("ep", position)
		if err != nil {
			t.Fatal(err)
		}
		tip, err := g.Tip("ep")
		if err != nil {
			t.Fatal(err)
		}
		return LedgerAt{Position: position, Head: head, Tip: tip.Hash}
	}
	call(0, 1)
	a := checkpoint(1)
	call(0, 2)
	b := checkpoint(2)
	if _, err := g.Restore("ep", true, a); err != nil {
		t.Fatal(err)
	}
	call(1, 2) // a new second call, in A's history
	c := checkpoint(2)
	st, err := g.Restore("ep", true, b)
	if err != nil || st.Attempt != 2 {
		t.Fatalf("restore of B onto the moved-on ledger: %+v %v", st, err)
	}
	l, _ := g.ledger("ep")
	if es := l.Entries(); len(es) != 2 || es[1].Hash != b.Head {
		t.Fatalf("after restoring B: %+v", es)
	}
	h, err := ledger.ReadIn(g.Ledgers(), "ep")
	if err != nil || len(h.Dropped) != 1 || h.Dropped[0].Hash != c.Head {
		t.Fatalf("the history left (C's second call) is not readable as dropped: %+v %v", h.Dropped, err)
	}
	// A copy of C, forked from C's tip while the ledger is B's.
	if _, err := g.Fork("ep", "copy", c); err != nil {
		t.Fatal(err)
	}
	cl, _ := g.ledger("copy")
	if es := cl.Entries(); len(es) != 2 || es[1].Response == nil || string(es[1].Request) != string(h.Dropped[0].Request) {
		t.Fatalf("the copy of C: %+v", es)
	}
	// And back to C itself.
	if st, err := g.Restore("ep", true, c); err != nil || st.Attempt != 3 {
		t.Fatalf("restore of C: %+v %v", st, err)
	}
	if es := l.Entries(); len(es) != 2 || es[1].Hash != c.Head {
		t.Fatalf("after restoring C: %+v", es)
	}
	if rep, err := ledger.VerifyIn(g.Ledgers(), "ep"); err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
	// A tip from another ledger is refused, and changes nothing.
	other := c
	other.Tip = strings.Repeat("ab", 32)
	if _, err := g.Restore("ep", true, other); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "another ledger") {
		t.Fatalf("restore with a foreign tip: %v", err)
	}
	if st, _ := g.Episode("ep"); st.Attempt != 3 {
		t.Fatalf("the refused restore raised the attempt to %d", st.Attempt)
	}
}

// TestRestoreInPlaceOfAnUnmatchedRelaunch: an episode relaunched from its
// saved session (two answers in it) is checkpointed, by a process-keeping
// snapshot, before its relay has had an answer: the relay does not know
// where in the ledger its harness is, and its hold says so (Unmatched,
// position 0). A restore of that snapshot in place cuts nothing and
// matches the harness's next call against the ledger, as a relaunch's: the
// ledger keeps the two answers the harness has and records the next call
// as the third, not as the first. So does a copy forked from it.
func TestRestoreInPlaceOfAnUnmatchedRelaunch(t *testing.T) {
	model := newFakeModel(t)
	g, gsrv := newTestGateway(t, model.srv.URL)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	conv := `{"role":"user","content":"task"}`
	for i := 1; i <= 3; i++ {
		if resp, b := gwCall(t, gsrv.URL, ep.Token, 0, fmt.Sprintf("ep/%d", i), `{"messages":[`+conv+`]}`); resp.StatusCode != 200 {
			t.Fatal(string(b))
		}
		conv += fmt.Sprintf(`,{"role":"assistant","content":"answer %d"},{"role":"user","content":"more"}`, i)
	}
	// A restore relaunches the harness from a session with two answers;
	// its relay starts after the ledger's calls and has had no answer
	// when the next checkpoint holds it.
	st, err := g.Restore("ep", false, LedgerAt{})
	if err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(t.TempDir(), "token.json")
	writeCreds(t, tok, st.Credentials(int64(st.Attempt)*1_000_000+1))
	r, err := New(Config{Upstream: gsrv.URL, TokenFile: tok})
	if err != nil {
		t.Fatal(err)
	}
	rsrv := httptest.NewServer(r.Handler())
	defer rsrv.Close()
	held, err := r.Hold()
	if err != nil || !held.Unmatched || held.Position != 0 {
		t.Fatalf("the hold of a relaunched relay with no answer yet: %+v %v", held, err)
	}
	l, _ := g.ledger("ep")
	tip := l.Tip().Hash
	at := LedgerAt{Position: held.Position, Tip: tip, Unmatched: held.Unmatched}

	// A copy of that snapshot, forked as the original is restored.
	if _, err := g.Fork("ep", "ep-b1", at); err != nil {
		t.Fatal(err)
	}
	cst, err := g.Restore("ep-b1", true, LedgerAt{Position: held.Position, Unmatched: true})
	if err != nil || !cst.NeedMatch {
		t.Fatalf("the copy's restore: %+v %v", cst, err)
	}
	// The snapshot, restored in place.
	st, err = g.Restore("ep", true, at)
	if err != nil || !st.NeedMatch || l.Len() != 3 {
		t.Fatalf("the restore in place: %+v %v, %d entries", st, err, l.Len())
	}
	writeCreds(t, tok, st.Credentials(0))
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	two := `{"role":"user","content":"task"},{"role":"assistant","content":"answer 1"},{"role":"user","content":"more"},{"role":"assistant","content":"answer 2"},{"role":"user","content":"more"}`
	if resp, b := post(t, rsrv.URL, `{"messages":[`+two+`]}`); resp.StatusCode != 200 {
		t.Fatalf("the harness's next call: %d %s", resp.StatusCode, b)
	}
	es := l.Entries()
	if len(es) != 3 || es[2].Attempt != st.Attempt || !es[2].Boundary || es[0].CallID != "ep/1" || es[1].CallID != "ep/2" {
		t.Fatalf("the ledger after the next call: %s", describeEntries(es))
	}
	eventually(t, "the relay learns its place", func() bool { return r.Delivered() == 3 })
	// The copy's first call is matched against the history it took.
	if resp, b := gwCall(t, gsrv.URL, cst.Token, cst.Attempt, "ep-b1/5000001", `{"messages":[`+two+`]}`); resp.StatusCode != 200 {
		t.Fatalf("the copy's first call: %d %s", resp.StatusCode, b)
	}
	cl, _ := g.ledger("ep-b1")
	if ces := cl.Entries(); len(ces) != 3 || !ces[2].Boundary || ces[2].CallID != "ep-b1/5000001" {
		t.Fatalf("the copy's ledger: %s", describeEntries(ces))
	}
	for _, id := range []string{"ep", "ep-b1"} {
		if rep, err := ledger.VerifyIn(g.Ledgers(), id); err != nil || !rep.OK || rep.Broken {
			t.Fatalf("%s: verify %+v %v", id, rep, err)
		}
	}
}

func describeEntries(es []ledger.Entry) string {
	var b strings.Builder
	for _, e := range es {
		fmt.Fprintf(&b, "%d:%s@%d boundary=%v; ", e.Seq, e.CallID, e.Attempt, e.Boundary)
	}
	return b.String()
}
