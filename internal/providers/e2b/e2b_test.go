package e2b_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/proc"
	"stasis/internal/providers/e2b"
	"stasis/internal/providers/e2b/e2bfake"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/sandbox"
	"stasis/sandbox/sandboxtest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

var ctx = context.Background()

// env is a fake E2B over a local provider, and an e2b provider pointed at
// it; everything is closed when the test ends.
type env struct {
	fake *e2bfake.Server
	url  string
	home string
	opts e2b.Options
	p    *e2b.Provider
}

func newEnv(t *testing.T, fo e2bfake.Options, mod func(*e2b.Options)) *env {
	t.Helper()
	home := t.TempDir()
	lp, err := local.New(local.Options{Home: home, Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	f := e2bfake.New(lp, fo)
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close) // after the fake has ended every process
	t.Cleanup(func() { _ = f.Close() })
	e := &env{fake: f, url: srv.URL, home: home}
	e.opts = e2b.Options{
		APIKey: f.APIKey(), BaseURL: srv.URL, EnvdURL: srv.URL, FileOnlySnapshots: true,
		Backoff: 20 * time.Millisecond, ReapInterval: -1,
	}
	if mod != nil {
		mod(&e.opts)
	}
	e.p = e.provider(t, e.opts)
	return e
}

// provider makes another provider (another process, as far as the service
// can tell) closed when the test ends.
func (e *env) provider(t *testing.T, o e2b.Options) *e2b.Provider {
	t.Helper()
	p, err := e2b.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// create makes a sandbox deleted when the test ends.
func (e *env) create(t *testing.T, p *e2b.Provider, spec sandbox.Spec) sandbox.Info {
	t.Helper()
	if spec.Expiry.IsZero() {
		spec.Expiry = time.Now().Add(10 * time.Minute)
	}
	info, err := p.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { _ = p.Delete(ctx, info.ID) })
	return info
}

// hostProcesses lists host processes whose command line mentions dir.
func hostProcesses(dir string) []int {
	all, _ := proc.All()
	var out []int
	for pid := range all {
		if pid == os.Getpid() {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		if strings.Contains(string(b), dir) {
			out = append(out, pid)
		}
	}
	return out
}

// requests are the API requests the fake received for a method and path.
func requests(f *e2bfake.Server, method, path string) []e2bfake.Request {
	var out []e2bfake.Request
	for _, r := range f.Requests() {
		if !r.Envd && r.Method == method && r.Path == path {
			out = append(out, r)
		}
	}
	return out
}

func timeoutOf(t *testing.T, r e2bfake.Request) int32 {
	t.Helper()
	var b struct {
		Timeout int32 `json:"timeout"`
	}
	if err := json.Unmarshal(r.Body, &b); err != nil {
		t.Fatalf("body of %s %s: %v: %s", r.Method, r.Path, err, r.Body)
	}
	return b.Timeout
}

func TestConformance(t *testing.T) {
	// A page limit of 3 makes every List walk pages.
	e := newEnv(t, e2bfake.Options{PageLimit: 3}, nil)
	if caps := e.p.Capabilities(); caps.KeepsProcesses || !caps.SnapshotOutlivesSource {
		t.Fatalf("capabilities over file-only snapshots: %+v", caps)
	}
	t.Run("suite", func(t *testing.T) {
		sandboxtest.Run(t, sandboxtest.Harness{
			Provider: e.p,
			FailFork: e.fake.FailFork,
			Retired:  e.fake.Retired,
			HostProcesses: func(id string) []int {
				var out []int
				for _, b := range e.fake.BackendIDs(id) {
					out = append(out, hostProcesses(filepath.Join(e.home, "sandboxes", "local", b))...)
				}
				return out
			},
		})
	})
	left, err := e.p.List(ctx, nil)
	if err != nil || len(left) != 0 {
		t.Errorf("sandboxes left after the suite: %+v %v", left, err)
	}
	if ids := e.fake.Sandboxes(); len(ids) != 0 {
		t.Errorf("the fake still holds %v", ids)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(hostProcesses(e.home)) > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if pids := hostProcesses(e.home); len(pids) > 0 {
		t.Errorf("host processes left: %v", pids)
	}
	stasistest.NoChildrenLeft(t)
}

func TestCapabilitiesKeepProcessesOnE2B(t *testing.T) {
	p, err := e2b.New(e2b.Options{APIKey: "e2b_x", ReapInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if caps := p.Capabilities(); !caps.KeepsProcesses || !caps.SnapshotOutlivesSource {
		t.Fatalf("capabilities: %+v", caps)
	}
}

func TestRateLimitHonoursRetryAfter(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	e.fake.Inject(e2bfake.Fault{Method: "GET", Path: "/sandboxes/nosuch", Status: http.StatusTooManyRequests, RetryAfter: time.Second, Times: 1})
	t0 := time.Now()
	_, err := e.p.Get(ctx, "nosuch")
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get after a 429: %v, want ErrNotFound from the retry", err)
	}
	reqs := requests(e.fake, "GET", "/sandboxes/nosuch")
	if len(reqs) != 2 || reqs[0].Status != http.StatusTooManyRequests {
		t.Fatalf("requests: %+v", reqs)
	}
	if gap := reqs[1].At.Sub(reqs[0].At); gap < time.Second || time.Since(t0) < time.Second {
		t.Fatalf("retried %s after a Retry-After of 1s", gap)
	}
	// A create is retried after a 429 too: E2B did nothing.
	e.fake.Inject(e2bfake.Fault{Method: "POST", Path: "/sandboxes", Status: http.StatusTooManyRequests, RetryAfter: time.Second, Times: 1})
	e.create(t, e.p, sandbox.Spec{})
	if creates := requests(e.fake, "POST", "/sandboxes"); len(creates) != 2 || creates[0].Status != 429 || creates[1].Status != 201 {
		t.Fatalf("creates: %+v", creates)
	}
	// A Retry-After beyond what the provider waits ends the call at once,
	// saying when to try again.
	p := e.provider(t, func() e2b.Options { o := e.opts; o.MaxRetryAfter = time.Second; return o }())
	e.fake.Inject(e2bfake.Fault{Method: "GET", Path: "/v2/sandboxes", Status: http.StatusTooManyRequests, RetryAfter: time.Hour, Times: 1})
	_, err = p.List(ctx, nil)
	var ae *e2b.APIError
	if !errors.As(err, &ae) || ae.Status != 429 || !strings.Contains(err.Error(), "1h0m0s") {
		t.Fatalf("list with Retry-After 1h: %v", err)
	}
}

func TestServerErrorRetriedThenSurfaced(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, func(o *e2b.Options) { o.Retries = 2 })
	undo := e.fake.Inject(e2bfake.Fault{Method: "GET", Path: "/sandboxes/", Status: http.StatusInternalServerError})
	_, err := e.p.Get(ctx, "sbx1")
	undo()
	var ae *e2b.APIError
	if !errors.As(err, &ae) || ae.Status != 500 || ae.Tries != 3 {
		t.Fatalf("get with E2B failing: %v", err)
	}
	for _, want := range []string{"sandbox sbx1", "500", "after 3 tries", "try again later"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if n := len(requests(e.fake, "GET", "/sandboxes/sbx1")); n != 3 {
		t.Fatalf("%d requests, want 3 (1 + 2 retries)", n)
	}
	// Once the service recovers, a retry gets through.
	e.fake.Inject(e2bfake.Fault{Method: "GET", Path: "/sandboxes/sbx2", Status: http.StatusBadGateway, Times: 2})
	if _, err := e.p.Get(ctx, "sbx2"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get after two 502s: %v", err)
	}
	// envd's plane: a 503 before a command starts is tried again.
	info := e.create(t, e.p, sandbox.Spec{})
	e.fake.Inject(e2bfake.Fault{Envd: true, Path: "/process.Process/Start", Status: http.StatusServiceUnavailable, Times: 1})
	var out bytes.Buffer
	if res, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"echo", "hi"}, Stdout: &out}); err != nil || res.ExitCode != 0 || out.String() != "hi\n" {
		t.Fatalf("exec after an envd 503: %+v %v %q", res, err, out.String())
	}
	starts := 0
	for _, r := range e.fake.Requests() {
		if r.Envd && r.Path == "/process.Process/Start" && bytes.Contains(r.Body, []byte(`"echo"`)) {
			starts++
		}
	}
	if starts != 2 {
		t.Fatalf("%d starts of echo, want 2", starts)
	}
	// A create is not retried after a 500: it may have made a sandbox.
	e.fake.Inject(e2bfake.Fault{Method: "POST", Path: "/sandboxes", Status: http.StatusInternalServerError, Times: 1})
	_, err = e.p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if !errors.As(err, &ae) || ae.Status != 500 || ae.Tries != 1 || !strings.Contains(err.Error(), "not retried") {
		t.Fatalf("create with a 500: %v", err)
	}
}

func TestSlowAnswerRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, func(o *e2b.Options) { o.RequestTimeout = 300 * time.Millisecond })
	e.fake.Inject(e2bfake.Fault{Method: "GET", Path: "/v2/sandboxes", Delay: 5 * time.Second, Times: 1})
	t0 := time.Now()
	if _, err := e.p.List(ctx, nil); err != nil {
		t.Fatalf("list after a slow answer: %v", err)
	}
	if d := time.Since(t0); d > 4*time.Second {
		t.Fatalf("the slow answer was waited for (%s)", d)
	}
	if n := len(requests(e.fake, "GET", "/v2/sandboxes")); n != 2 {
		t.Fatalf("%d list requests, want 2", n)
	}
}

func TestUnauthorizedNamesTheKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	o := e.opts
	o.APIKey = "e2b_wrong"
	p := e.provider(t, o)
	_, err := p.List(ctx, nil)
	var ae *e2b.APIError
	if !errors.As(err, &ae) || ae.Status != http.StatusUnauthorized || !strings.Contains(err.Error(), "E2B_API_KEY") {
		t.Fatalf("list with a wrong key: %v", err)
	}
	if _, err := e2b.New(e2b.Options{}); err == nil || !strings.Contains(err.Error(), "E2B_API_KEY") {
		t.Fatalf("new without a key: %v", err)
	}
}

func TestErrorsAreTyped(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	checks := map[string]error{}
	_, checks["get"] = e.p.Get(ctx, "nosuch")
	_, checks["exec"] = e.p.Exec(ctx, "nosuch", sandbox.ExecRequest{Argv: []string{"true"}})
	_, checks["read"] = e.p.ReadFile(ctx, "nosuch", "/work/x")
	checks["set-expiry"] = e.p.SetExpiry(ctx, "nosuch", time.Now().Add(time.Hour))
	_, checks["snapshot"] = e.p.Snapshot(ctx, "nosuch", "")
	_, checks["get-snapshot"] = e.p.GetSnapshot(ctx, "nosuch:default")
	_, checks["fork"] = e.p.Fork(ctx, "nosuch:default", 2, sandbox.ForkSpec{Expiry: time.Now().Add(time.Hour)})
	_, checks["resume"] = e.p.Resume(ctx, "nosuch")
	for op, err := range checks {
		if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "nosuch") {
			t.Errorf("%s of nothing: %v, want ErrNotFound naming it", op, err)
		}
	}
	if err := e.p.Delete(ctx, "nosuch"); err != nil {
		t.Errorf("delete of nothing: %v", err)
	}
	if err := e.p.DeleteSnapshot(ctx, "nosuch:default"); err != nil {
		t.Errorf("delete-snapshot of nothing: %v", err)
	}
	if _, err := e.p.Create(ctx, sandbox.Spec{Image: "no-such-template", Expiry: time.Now().Add(time.Hour)}); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "no-such-template") {
		t.Errorf("create from an unknown template: %v", err)
	}
	if _, err := e.p.Create(ctx, sandbox.Spec{Labels: map[string]string{e2b.MetaExpiry: "x"}, Expiry: time.Now().Add(time.Hour)}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("create with a reserved label: %v", err)
	}
	// 409 is ErrWrongState, 400 ErrInvalid, both naming the sandbox.
	info := e.create(t, e.p, sandbox.Spec{})
	e.fake.Inject(e2bfake.Fault{Method: "POST", Path: "/sandboxes/" + info.ID + "/snapshots", Status: http.StatusConflict, Times: 1})
	if _, err := e.p.Snapshot(ctx, info.ID, ""); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), info.ID) {
		t.Errorf("snapshot answered 409: %v", err)
	}
	e.fake.Inject(e2bfake.Fault{Method: "POST", Path: "/sandboxes/" + info.ID + "/timeout", Status: http.StatusBadRequest, Times: 1})
	if err := e.p.SetExpiry(ctx, info.ID, time.Now().Add(time.Hour)); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), info.ID) {
		t.Errorf("set-expiry answered 400: %v", err)
	}
}

func TestVanishedSandbox(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	info := e.create(t, e.p, sandbox.Spec{})
	if !e.fake.Vanish(info.ID) {
		t.Fatal("the fake had no such sandbox")
	}
	_, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "early") || !strings.Contains(err.Error(), info.ID) {
		t.Fatalf("exec in a vanished sandbox: %v", err)
	}
	if _, err := e.p.Get(ctx, info.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get of a vanished sandbox: %v", err)
	}
	if n := e.fake.Retired(info.ID); n != 0 {
		t.Fatalf("a vanished sandbox was deleted %d times", n)
	}
}

// clock is a provider clock that tests move forward.
// clock is the client's clock in the expiry tests: a moment fixed when the
// test binary started, moved only by advance, so the seconds of a lease
// the client sends do not depend on how long the test takes (they did:
// 497 for 500 under load).
type clock struct{ off atomic.Int64 }

var clockBase = time.Now()

func (c *clock) now() time.Time { return clockBase.Add(time.Duration(c.off.Load())) }

func (c *clock) advance(d time.Duration) { c.off.Add(int64(d)) }

func secsUntil(t, now time.Time) int32 { return int32(math.Ceil(t.Sub(now).Seconds())) }

func near(a, b int32) bool { return a-b <= 1 && b-a <= 1 }

func TestExpiryNeverShiftedByPauseOrFork(t *testing.T) {
	t.Parallel()
	var c clock
	e := newEnv(t, e2bfake.Options{}, func(o *e2b.Options) { o.Now = c.now })
	expiry := c.now().Add(10 * time.Minute)
	info := e.create(t, e.p, sandbox.Spec{Expiry: expiry, Files: map[string][]byte{"/work/f": []byte("kept")}})
	if creates := requests(e.fake, "POST", "/sandboxes"); len(creates) != 1 || !near(timeoutOf(t, creates[0]), 600) {
		t.Fatalf("create sent %+v, want a timeout of 600s", creates)
	}
	if !info.Expiry.Equal(expiry) {
		t.Fatalf("info expiry %s, want %s", info.Expiry, expiry)
	}

	// Pause, let 100s pass, resume: the timeout sent is what is left of
	// the lease, not the lease again.
	if err := e.p.Pause(ctx, info.ID); err != nil {
		t.Fatal(err)
	}
	if st := e.fake.State(info.ID); st != "paused" {
		t.Fatalf("state after pause: %q", st)
	}
	if got, err := e.p.Get(ctx, info.ID); err != nil || got.State != e2b.StatePaused || !got.Expiry.Equal(expiry) {
		t.Fatalf("get while paused: %+v %v", got, err)
	}
	if _, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("exec while paused: %v", err)
	}
	if err := e.p.SetExpiry(ctx, info.ID, expiry.Add(time.Hour)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("set-expiry while paused: %v", err)
	}
	c.advance(100 * time.Second)
	got, err := e.p.Resume(ctx, info.ID)
	if err != nil {
		t.Fatal(err)
	}
	connects := requests(e.fake, "POST", "/sandboxes/"+info.ID+"/connect")
	if len(connects) != 1 || !near(timeoutOf(t, connects[0]), secsUntil(expiry, c.now())) || !near(timeoutOf(t, connects[0]), 500) {
		t.Fatalf("connect sent %+v, want the 500s left of the lease", connects)
	}
	if !got.Expiry.Equal(expiry) || got.State != sandbox.StateRunning {
		t.Fatalf("resumed %+v", got)
	}
	if b, err := e.p.ReadFile(ctx, info.ID, "/work/f"); err != nil || string(b) != "kept" {
		t.Fatalf("a file across pause and resume: %q %v", b, err)
	}

	// Snapshot and fork: the source's end does not move; the forks get
	// the ForkSpec's expiry.
	end0, _ := e.fake.EndAt(info.ID)
	before := len(e.fake.Requests())
	snap, err := e.p.Snapshot(ctx, info.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.p.DeleteSnapshot(ctx, snap.ID) })
	c.advance(50 * time.Second)
	forkExpiry := c.now().Add(5 * time.Minute)
	forks, err := e.p.Fork(ctx, snap.ID, 2, sandbox.ForkSpec{Labels: map[string]string{"k": "v"}, Expiry: forkExpiry})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range forks {
		id := f.ID
		t.Cleanup(func() { _ = e.p.Delete(ctx, id) })
		if !f.Expiry.Equal(forkExpiry) || f.Source != snap.ID || f.Labels["k"] != "v" {
			t.Fatalf("fork %+v", f)
		}
	}
	for _, r := range e.fake.Requests()[before:] {
		if r.Envd {
			continue
		}
		switch {
		case r.Method == "POST" && r.Path == "/sandboxes":
			// Sent between the fork's start (300 s left) and now (a
			// loaded machine may take seconds over the forks).
			if ts := timeoutOf(t, r); ts > 301 || ts < secsUntil(forkExpiry, c.now())-1 {
				t.Errorf("fork create sent a timeout of %ds, want 300 less the time the fork took", ts)
			}
		case strings.HasPrefix(r.Path, "/sandboxes/"+info.ID+"/") && r.Path != "/sandboxes/"+info.ID+"/snapshots":
			t.Errorf("snapshot or fork sent %s %s to the source", r.Method, r.Path)
		}
	}
	if end1, _ := e.fake.EndAt(info.ID); !end1.Equal(end0) {
		t.Fatalf("the source's end moved from %s to %s", end0, end1)
	}
	if got, err := e.p.Get(ctx, info.ID); err != nil || !got.Expiry.Equal(expiry) {
		t.Fatalf("source after the fork: %+v %v", got, err)
	}

	// SetExpiry sends what is left of the new lease.
	newExpiry := c.now().Add(20 * time.Minute)
	if err := e.p.SetExpiry(ctx, info.ID, newExpiry); err != nil {
		t.Fatal(err)
	}
	sets := requests(e.fake, "POST", "/sandboxes/"+info.ID+"/timeout")
	if len(sets) == 0 || !near(timeoutOf(t, sets[len(sets)-1]), secsUntil(newExpiry, c.now())) || !near(timeoutOf(t, sets[len(sets)-1]), 1200) {
		t.Fatalf("set-expiry sent %+v", sets)
	}

	// A live fork snapshots and forks; its snapshot is returned.
	lsnap, lforks, err := e.p.ForkSandbox(ctx, info.ID, 1, sandbox.ForkSpec{Expiry: forkExpiry})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.p.DeleteSnapshot(ctx, lsnap.ID) })
	t.Cleanup(func() { _ = e.p.Delete(ctx, lforks[0].ID) })
	if b, err := e.p.ReadFile(ctx, lforks[0].ID, "/work/f"); err != nil || string(b) != "kept" {
		t.Fatalf("a file in a live fork: %q %v", b, err)
	}
}

func TestExpiryFoundByAnotherProcess(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	expiry := time.Now().Add(30 * time.Minute).Truncate(time.Millisecond)
	a := e.create(t, e.p, sandbox.Spec{Expiry: expiry, Labels: map[string]string{"team": "rl"}})
	b := e.create(t, e.p, sandbox.Spec{Expiry: expiry})
	moved := time.Now().Add(2 * time.Hour)
	if err := e.p.SetExpiry(ctx, b.ID, moved); err != nil {
		t.Fatal(err)
	}
	other := e.provider(t, e.opts)
	got, err := other.Get(ctx, a.ID)
	if err != nil || !got.Expiry.Equal(expiry) || got.Labels["team"] != "rl" || got.Provider != e2b.Name {
		t.Fatalf("another process's get: %+v %v (want expiry %s)", got, err, expiry)
	}
	got, err = other.Get(ctx, b.ID)
	if err != nil || got.Expiry.Before(moved) || got.Expiry.After(moved.Add(2*time.Second)) {
		t.Fatalf("another process sees the moved expiry as %s, want %s", got.Expiry, moved)
	}
	list, err := other.List(ctx, map[string]string{"team": "rl"})
	if err != nil || len(list) != 1 || list[0].ID != a.ID || !list[0].Expiry.Equal(expiry) {
		t.Fatalf("another process's list: %+v %v", list, err)
	}
	// And it can run commands there.
	var out bytes.Buffer
	if res, err := other.Exec(ctx, a.ID, sandbox.ExecRequest{Argv: []string{"pwd"}, Stdout: &out}); err != nil || res.ExitCode != 0 || out.String() != "/work\n" {
		t.Fatalf("exec from another process: %+v %v %q", res, err, out.String())
	}
}

func TestStasisDeletesAtExpiryEvenWhenTheServiceDoesNot(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	e.fake.IgnoreTimeouts(true)
	a := e.create(t, e.p, sandbox.Spec{})
	b := e.create(t, e.p, sandbox.Spec{})
	keep := e.create(t, e.p, sandbox.Spec{})
	for _, id := range []string{a.ID, b.ID} {
		if err := e.p.SetExpiry(ctx, id, time.Now().Add(time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	// A call on a sandbox past its expiry deletes it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := e.p.Exec(ctx, a.ID, sandbox.ExecRequest{Argv: []string{"true"}})
		if errors.Is(err, errdefs.ErrExpired) {
			break
		}
		if err != nil || time.Now().After(deadline) {
			t.Fatalf("exec while waiting for the expiry: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if n := e.fake.Retired(a.ID); n != 1 || e.fake.State(a.ID) != "" {
		t.Fatalf("sandbox past its expiry: deleted %d times, state %q", n, e.fake.State(a.ID))
	}
	if got, err := e.p.Get(ctx, a.ID); !errors.Is(err, errdefs.ErrExpired) || got.State != sandbox.StateExpired {
		t.Fatalf("get after the expiry: %+v %v", got, err)
	}
	// The reaper of another process, which knows b's expiry only from
	// the service, deletes it untouched.
	o := e.opts
	o.ReapInterval = 100 * time.Millisecond
	e.provider(t, o)
	for e.fake.State(b.ID) != "" {
		if time.Now().After(deadline) {
			t.Fatal("the reaper did not delete a sandbox past its expiry")
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if n := e.fake.Retired(b.ID); n != 1 {
		t.Fatalf("reaped sandbox deleted %d times", n)
	}
	if e.fake.State(keep.ID) != "running" {
		t.Fatal("the reaper deleted a sandbox within its lease")
	}
}

func TestPartialForkSaysWhichFailed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	src := e.create(t, e.p, sandbox.Spec{})
	snap, err := e.p.Snapshot(ctx, src.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.p.DeleteSnapshot(ctx, snap.ID) })
	if got, err := e.p.GetSnapshot(ctx, snap.ID); err != nil || got.ID != snap.ID || got.Sandbox != src.ID {
		t.Fatalf("get-snapshot: %+v %v", got, err)
	}
	undo := e.fake.FailFork(snap.ID, 2)
	_, err = e.p.Fork(ctx, snap.ID, 3, sandbox.ForkSpec{Labels: map[string]string{"partial": "1"}, Expiry: time.Now().Add(time.Hour)})
	undo()
	if err == nil || !strings.Contains(err.Error(), "of 3 failed") || !strings.Contains(err.Error(), "none is kept") {
		t.Fatalf("partial fork: %v", err)
	}
	if left, err := e.p.List(ctx, map[string]string{"partial": "1"}); err != nil || len(left) != 0 {
		t.Fatalf("a failed fork left %+v %v", left, err)
	}
}

func TestExecStreamsAndKills(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	info := e.create(t, e.p, sandbox.Spec{Env: map[string]string{"A": "spec"}})
	// Output streams while the command runs.
	pr, pw := newLineWatch("ready")
	done := make(chan error, 1)
	go func() {
		_, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", `echo ready; echo "$A" >&2; sleep 30`}, Stdout: pw, Timeout: 20 * time.Second})
		done <- err
	}()
	select {
	case <-pr:
	case err := <-done:
		t.Fatalf("exec ended before its output streamed: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatal("no streamed output")
	}
	// A context cancelled ends the command.
	cctx, cancel := context.WithCancel(ctx)
	res := make(chan error, 1)
	go func() {
		_, err := e.p.Exec(cctx, info.ID, sandbox.ExecRequest{Argv: []string{"sleep", "60"}})
		res <- err
	}()
	cancel()
	if err := <-res; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled exec: %v", err)
	}
	// A signal's exit code is minus its number.
	r, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", "kill -TERM $$"}})
	if err != nil || r.ExitCode != -15 {
		t.Fatalf("a command killed by SIGTERM: %+v %v", r, err)
	}
	// A working directory that does not exist is the caller's mistake.
	if _, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}, Cwd: "/no/such/dir"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("exec in a missing directory: %v", err)
	}
	// Background output goes to its log.
	bg, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", `echo "bg $A"`}, Background: true, LogPath: "/tmp/logs/bg.log"})
	if err != nil || bg.PID <= 0 {
		t.Fatalf("background: %+v %v", bg, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := e.p.ReadFile(ctx, info.ID, "/tmp/logs/bg.log")
		if string(b) == "bg spec\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("background log %q", b)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if err := e.p.Delete(ctx, info.ID); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err == nil {
		t.Fatal("a command in a deleted sandbox reported success")
	}
}

// newLineWatch is a writer that signals when a line is written.
func newLineWatch(line string) (<-chan struct{}, *lineWatch) {
	ch := make(chan struct{})
	return ch, &lineWatch{line: line, ch: ch}
}

type lineWatch struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	line string
	ch   chan struct{}
	done bool
}

func (w *lineWatch) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(b)
	if !w.done && strings.Contains(w.buf.String(), w.line+"\n") {
		w.done = true
		close(w.ch)
	}
	return len(b), nil
}

func TestListWalksPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{PageLimit: 2}, nil)
	want := map[string]bool{}
	for i := 0; i < 5; i++ {
		want[e.create(t, e.p, sandbox.Spec{Labels: map[string]string{"batch": "b", "odd": strconv.FormatBool(i%2 == 1)}}).ID] = true
	}
	// A sandbox with another value is not listed.
	e.create(t, e.p, sandbox.Spec{Labels: map[string]string{"batch": "other"}})
	before := len(requests(e.fake, "GET", "/v2/sandboxes"))
	list, err := e.p.List(ctx, map[string]string{"batch": "b"})
	if err != nil || len(list) != 5 {
		t.Fatalf("list: %d %v", len(list), err)
	}
	for _, in := range list {
		if !want[in.ID] {
			t.Fatalf("listed %s", in.ID)
		}
	}
	if pages := len(requests(e.fake, "GET", "/v2/sandboxes")) - before; pages != 3 {
		t.Fatalf("5 sandboxes in %d pages, want 3 of at most 2", pages)
	}
	// A label value E2B's filter cannot carry is matched by the provider.
	odd := e.create(t, e.p, sandbox.Spec{Labels: map[string]string{"q": "a=b&c"}})
	if list, err := e.p.List(ctx, map[string]string{"q": "a=b&c"}); err != nil || len(list) != 1 || list[0].ID != odd.ID {
		t.Fatalf("list by an awkward label: %+v %v", list, err)
	}
}

func TestSeedFromDirectory(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2bfake.Options{}, nil)
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sub", "x.sh"), []byte("echo x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("sub/x.sh", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	info := e.create(t, e.p, sandbox.Spec{Root: dir})
	var out bytes.Buffer
	res, err := e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", `stat -c %a sub/x.sh; readlink link; ./link`}, Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "755\nsub/x.sh\nx\n" {
		t.Fatalf("seeded work tree: %+v %v %q", res, err, out.String())
	}
}

// TestLive runs the conformance suite against E2B itself when E2B_API_KEY
// is set (with E2B_DOMAIN, E2B_API_URL and E2B_SANDBOX_URL as the SDKs read
// them).
func TestLive(t *testing.T) {
	if os.Getenv(e2b.EnvAPIKey) == "" {
		t.Skip("E2B_API_KEY is not set: the live test runs the conformance suite against E2B itself when it is")
	}
	var mu sync.Mutex
	fail := map[string]int{}
	retired := map[string]int{}
	o := e2b.FromEnv()
	o.Scope = "stasis-live-test"
	o.ForkHook = func(snapshot string, i int) error {
		mu.Lock()
		defer mu.Unlock()
		if k, ok := fail[snapshot]; ok && k == i {
			return errors.New("injected fork failure")
		}
		return nil
	}
	o.HTTPClient = &http.Client{Transport: countDeletes{next: http.DefaultTransport, count: func(id string) {
		mu.Lock()
		retired[id]++
		mu.Unlock()
	}}}
	p, err := e2b.New(o)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	sandboxtest.Run(t, sandboxtest.Harness{
		Provider: p,
		FailFork: func(snapshot string, k int) func() {
			mu.Lock()
			fail[snapshot] = k
			mu.Unlock()
			return func() { mu.Lock(); delete(fail, snapshot); mu.Unlock() }
		},
		Retired: func(id string) int {
			mu.Lock()
			defer mu.Unlock()
			return retired[id]
		},
		ExpiryStep: 5 * time.Second,
	})
}

// countDeletes counts the DELETE /sandboxes/{id} that E2B answered 204.
type countDeletes struct {
	next  http.RoundTripper
	count func(id string)
}

func (c countDeletes) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.next.RoundTrip(r)
	if err == nil && r.Method == http.MethodDelete && resp.StatusCode == http.StatusNoContent {
		if id, ok := strings.CutPrefix(r.URL.Path, "/sandboxes/"); ok && !strings.Contains(id, "/") {
			c.count(id)
		}
	}
	return resp, err
}
