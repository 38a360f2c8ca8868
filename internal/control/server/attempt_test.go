package server_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"stasis/internal/control/server"
	"stasis/internal/control/system"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// startServerWith starts a server on state, in this process, with the
// system's configuration adjusted by adjust.
func startServerWith(t *testing.T, ctx context.Context, state string, adjust func(*system.Config)) *running {
	t.Helper()
	cfg := system.Config{
		State: state, Exe: stasistest.Exe(), ExeEnv: stasistest.Env, Binary: stasistest.Exe(), BinaryEnv: binaryEnv, Concurrency: 4,
	}
	if adjust != nil {
		adjust(&cfg)
	}
	srv, err := server.New(ctx, server.Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	return &running{srv: srv, ts: ts, api: &client{t: t, base: ts.URL}}
}

// ledgerOf reads an episode's whole ledger through the API.
func ledgerOf(c *client, id string) server.LedgerResponse {
	c.t.Helper()
	var l server.LedgerResponse
	c.call("GET", "/v1/episodes/"+id+"/ledger?bodies=false", nil, http.StatusOK, &l)
	return l
}

// A trainer starts a retired episode, and one a crash lost, again under
// its own id: each is its next attempt, from its task's work tree, with a
// ledger that starts empty (the earlier attempt's entries dropped, kept),
// and each is resolved. An id that runs is refused, and so is a restart
// with another task.
func TestStartAgainAsNextAttempt(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	g, mw := hold("", 3) // every episode's first attempt stops at its third call
	defer g.Release()
	r := startServer(t, ctx, state, mw)
	closed := false
	defer func() {
		if !closed {
			r.Close()
		}
	}()
	api := r.api
	for _, id := range []string{"ep-retired", "ep-lost"} {
		api.call("POST", "/v1/episodes", map[string]any{"id": id, "task": "sh-renext-spaces", "harness": "mini"}, http.StatusCreated, nil)
	}
	if err := g.Wait(ctx, 2); err != nil {
		t.Fatal("the third calls never came")
	}
	api.refuse("POST", "/v1/episodes", map[string]any{"id": "ep-retired", "task": "sh-renext-spaces", "harness": "mini"}, http.StatusConflict, "conflict", "retire it first")
	var v view
	api.call("POST", "/v1/episodes/ep-retired/retire", nil, http.StatusOK, &v)
	old := v.Sandbox
	api.refuse("POST", "/v1/episodes", map[string]any{"id": "ep-retired", "task": "sh-envget-unanchored-key", "harness": "mini"}, http.StatusConflict, "conflict", "ran task sh-renext-spaces")

	// A crash: the server goes, and every sandbox with it.
	r.Close()
	closed = true
	if _, err := local.Crash(filepath.Join(state, "local")); err != nil {
		t.Fatal(err)
	}
	r = startServer(t, ctx, state, mw)
	closed = false
	api = r.api
	if v = api.episode("ep-lost"); v.State != store.EpisodeLost {
		t.Fatalf("ep-lost after the crash: %+v", v)
	}

	for _, id := range []string{"ep-retired", "ep-lost"} {
		api.call("POST", "/v1/episodes", map[string]any{"id": id, "task": "sh-renext-spaces", "harness": "mini"}, http.StatusCreated, &v)
		if v.Attempt != 1 || v.State != store.EpisodeRunning || !v.Live || v.Sandbox == "" || v.Sandbox == old || v.Reward != nil {
			t.Fatalf("%s started again: %+v", id, v)
		}
	}
	for _, id := range []string{"ep-retired", "ep-lost"} {
		api.waitExited(ctx, id)
		if vd := api.verify(id, false); vd.Attempt != 1 {
			t.Errorf("%s: verified attempt %d, want 1", id, vd.Attempt)
		}
		l := ledgerOf(api, id)
		if l.Broken || len(l.Entries) < 5 || len(l.Dropped) != 2 {
			t.Fatalf("%s's ledger: %d live, %d dropped, broken %v", id, len(l.Entries), len(l.Dropped), l.Broken)
		}
		for i, e := range l.Entries {
			if e.Attempt != 1 || e.Seq != int64(i+1) || !strings.HasPrefix(e.CallID, id+"/100000") || e.Disposition != ledger.Delivered {
				t.Errorf("%s's entry %d: attempt %d, seq %d, call %s, %s", id, i, e.Attempt, e.Seq, e.CallID, e.Disposition)
			}
		}
		for _, e := range l.Dropped {
			if e.Attempt != 0 {
				t.Errorf("%s's dropped entry %s is of attempt %d", id, e.CallID, e.Attempt)
			}
		}
		var rep ledger.Report
		api.call("GET", "/v1/episodes/"+id+"/ledger/verify", nil, http.StatusOK, &rep)
		if !rep.OK {
			t.Errorf("%s's ledger does not verify: %+v", id, rep)
		}
		api.call("POST", "/v1/episodes/"+id+"/retire", nil, http.StatusOK, nil)
	}
}

// gatedProvider holds every Create or Snapshot (whichever gate is set)
// until the gate opens, telling entered when the first one starts.
type gatedProvider struct {
	sandbox.Provider
	create, snapshot atomic.Pointer[gate]
}

type gate struct {
	entered, open chan struct{}
	once, opened  sync.Once
}

func newGate() *gate { return &gate{entered: make(chan struct{}), open: make(chan struct{})} }

func (g *gate) pass() {
	if g == nil {
		return
	}
	g.once.Do(func() { close(g.entered) })
	<-g.open
}

func (g *gate) Open() { g.opened.Do(func() { close(g.open) }) }

func (p *gatedProvider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	p.create.Load().pass()
	return p.Provider.Create(ctx, spec)
}

func (p *gatedProvider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	p.snapshot.Load().pass()
	return p.Provider.Snapshot(ctx, id, name)
}

// notWithin is how long a request that must wait is given to answer all
// the same before the test lets what it waits for go on: a start takes a
// second or two here, so one that has not answered by then is waiting.
const notWithin = 8 * time.Second

// A start and a checkpoint do not overlap (what the trainer sees is
// documented in the OpenAPI document): a start asked while a checkpoint
// runs is admitted after it, and its episode is not in it; a checkpoint
// asked while a start is under way waits for it, and its episode is in
// it.
func TestStartWhileCheckpointOpen(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	p := &gatedProvider{}
	g, mw := hold("", 2)
	defer g.Release()
	r := startServerWith(t, ctx, state, func(c *system.Config) {
		c.GatewayMiddleware = mw
		c.WrapProvider = func(inner sandbox.Provider) sandbox.Provider { p.Provider = inner; return p }
	})
	defer r.Close()
	var gates []*gate
	defer func() { // before the server closes, which waits for its requests
		for _, g := range gates {
			g.Open()
		}
	}()
	api := r.api
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-1", "task": "sh-renext-spaces", "harness": "mini"}, http.StatusCreated, nil)

	type answer struct {
		what string
		code int
		body []byte
	}
	answers := make(chan answer, 2)
	post := func(what, path string, body any) {
		go func() {
			code, b := api.do("POST", path, body)
			answers <- answer{what, code, b}
		}()
	}
	// next is the next answer; the gate opens if none comes within
	// notWithin (the request waits, as it should).
	next := func(open *gate) answer {
		select {
		case a := <-answers:
			return a
		case <-time.After(notWithin): // bounds a wait that must not end
			open.Open()
			return <-answers
		}
	}

	// A start while the checkpoint's snapshot is held.
	held := newGate()
	gates = append(gates, held)
	p.snapshot.Store(held)
	post("checkpoint", "/v1/checkpoints", map[string]any{"id": "ck-1"})
	select {
	case <-held.entered:
	case <-ctx.Done():
		t.Fatal("the checkpoint's snapshot never began")
	}
	post("start", "/v1/episodes", map[string]any{"id": "ep-2", "task": "sh-renext-spaces", "harness": "mini"})
	first := next(held)
	held.Open()
	second := <-answers
	if first.what != "checkpoint" || first.code != http.StatusCreated || second.code != http.StatusCreated {
		t.Fatalf("a start asked while a checkpoint ran answered before it: first %s %d %s; then %s %d %s", first.what, first.code, first.body, second.what, second.code, second.body)
	}
	if strings.Contains(string(first.body), `"ep-2"`) {
		t.Fatalf("ep-2, started while ck-1 ran, is in it: %s", first.body)
	}
	p.snapshot.Store(nil)

	// A checkpoint while a start's sandbox is being made.
	held = newGate()
	gates = append(gates, held)
	p.create.Store(held)
	post("start", "/v1/episodes", map[string]any{"id": "ep-3", "task": "sh-renext-spaces", "harness": "mini"})
	select {
	case <-held.entered:
	case <-ctx.Done():
		t.Fatal("ep-3's sandbox was never begun")
	}
	post("checkpoint", "/v1/checkpoints", map[string]any{"id": "ck-2"})
	first = next(held)
	held.Open()
	second = <-answers
	if first.what != "start" || first.code != http.StatusCreated || second.code != http.StatusCreated {
		t.Fatalf("a checkpoint asked while a start ran answered before it: first %s %d %s; then %s %d %s", first.what, first.code, first.body, second.what, second.code, second.body)
	}
	var ck server.CheckpointResponse
	if err := json.Unmarshal(second.body, &ck); err != nil || len(ck.Episodes) != 3 {
		t.Fatalf("ck-2 should hold ep-1, ep-2 and ep-3: %s", second.body)
	}
	p.create.Store(nil)

	g.Release()
	for _, id := range []string{"ep-1", "ep-2", "ep-3"} {
		api.waitExited(ctx, id)
		api.verify(id, false)
		api.call("POST", "/v1/episodes/"+id+"/retire", nil, http.StatusOK, nil)
	}
}
