package opensandbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/local"
	"stasis/internal/providers/opensandbox"
	"stasis/internal/providers/opensandbox/osfake"
	"stasis/internal/stasistest"
	"stasis/sandbox"
	"stasis/sandbox/sandboxtest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

var ctx = context.Background()

const apiKey = "test-key"

type env struct {
	p       *opensandbox.Provider
	f       *osfake.Fake
	url     string
	backend *local.Provider
}

// newEnv starts a fake server over a fresh local provider and a provider
// for it; everything is stopped and removed when the test ends.
func newEnv(t *testing.T, fo osfake.Options, po opensandbox.Options) *env {
	t.Helper()
	backend, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	fo.Backend = backend
	if fo.APIKey == "" {
		fo.APIKey = apiKey
	}
	f := osfake.New(fo)
	srv := httptest.NewServer(f)
	t.Cleanup(func() {
		srv.Close()
		f.Close()
	})
	e := &env{f: f, url: srv.URL, backend: backend}
	e.p = e.provider(t, po)
	return e
}

// provider makes another provider for the env's server.
func (e *env) provider(t *testing.T, po opensandbox.Options) *opensandbox.Provider {
	t.Helper()
	po.URL = e.url
	if po.APIKey == "" {
		po.APIKey = apiKey
	}
	if po.PollInterval == 0 {
		po.PollInterval = 10 * time.Millisecond
	}
	if po.RetryBase == 0 {
		po.RetryBase = 10 * time.Millisecond
	}
	p, err := opensandbox.New(po)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// create makes a sandbox deleted when the test ends.
func (e *env) create(t *testing.T) sandbox.Info {
	t.Helper()
	info, err := e.p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.p.Delete(ctx, info.ID); err != nil {
			t.Errorf("delete %s: %v", info.ID, err)
		}
	})
	return info
}

func sh(t *testing.T, p sandbox.Provider, id, script string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &errb, Timeout: time.Minute})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	return out.String(), errb.String(), res.ExitCode
}

func TestConformance(t *testing.T) {
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	t.Run("suite", func(t *testing.T) {
		sandboxtest.Run(t, sandboxtest.Harness{Provider: e.p, FailFork: e.f.FailFork, Retired: e.f.Retired})
	})
	if left, err := e.p.List(ctx, nil); err != nil || len(left) != 0 {
		t.Errorf("sandboxes left after the suite: %+v %v", left, err)
	}
}

// TestLive runs the conformance suite against a real OpenSandbox server.
func TestLive(t *testing.T) {
	if os.Getenv("OPENSANDBOX_URL") == "" {
		t.Skip("OPENSANDBOX_URL is not set: set it (and OPENSANDBOX_API_KEY, optionally OPENSANDBOX_IMAGE) to run the conformance suite against a real OpenSandbox server")
	}
	var mu sync.Mutex
	fail := map[string]int{}
	p, err := opensandbox.New(opensandbox.Options{
		URL: os.Getenv("OPENSANDBOX_URL"), APIKey: os.Getenv("OPENSANDBOX_API_KEY"), Image: os.Getenv("OPENSANDBOX_IMAGE"),
		ForkHook: func(snapshot string, i int) error {
			mu.Lock()
			defer mu.Unlock()
			if k, ok := fail[snapshot]; ok && k == i {
				return errors.New("injected fork failure")
			}
			return nil
		},
	})
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
	})
}

func TestFromEnv(t *testing.T) {
	t.Setenv("OPENSANDBOX_URL", "")
	if _, err := opensandbox.FromEnv(); err == nil || !strings.Contains(err.Error(), "OPENSANDBOX_URL") {
		t.Fatalf("no URL: %v", err)
	}
	t.Setenv("OPENSANDBOX_URL", "ftp://nowhere")
	if _, err := opensandbox.FromEnv(); err == nil || !strings.Contains(err.Error(), "OPENSANDBOX_URL") {
		t.Fatalf("bad URL: %v", err)
	}
	t.Setenv("OPENSANDBOX_URL", "http://127.0.0.1:1")
	t.Setenv("OPENSANDBOX_API_KEY", "k")
	p, err := opensandbox.FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if c := p.Capabilities(); c.KeepsProcesses || !c.SnapshotOutlivesSource || c.ConsumesSnapshotOnRestore || p.Name() != "opensandbox" {
		t.Fatalf("capabilities %+v", c)
	}
}

// TestExecOutput checks what the line events of execd give back: exact
// bytes, with or without final newlines, empty lines, stderr apart, exit
// codes, stdin, a background command's log.
func TestExecOutput(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	id := e.create(t).ID
	for _, c := range []struct{ script, out, errOut string }{
		{`printf 'a\n\nb'`, "a\n\nb", ""},
		{`printf '\n\n'; printf 'e1\ne2\n' >&2`, "\n\n", "e1\ne2\n"},
		{`true`, "", ""},
		{`printf 'x\r\ny\n'`, "x\ny\n", ""},
		{`seq 1 20000`, func() string {
			var b strings.Builder
			for i := 1; i <= 20000; i++ {
				fmt.Fprintf(&b, "%d\n", i)
			}
			return b.String()
		}(), ""},
	} {
		out, errOut, code := sh(t, e.p, id, c.script)
		if out != c.out || errOut != c.errOut || code != 0 {
			t.Errorf("%q: out %q err %q code %d", c.script, trunc(out), errOut, code)
		}
	}
	var both bytes.Buffer
	if _, err := e.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", "echo out1; sleep 0.3; echo err1 >&2; sleep 0.3; echo out2"}, Stdout: &both, Stderr: &both}); err != nil || both.String() != "out1\nerr1\nout2\n" {
		t.Errorf("one writer for both streams: %q %v", both.String(), err)
	}
	if _, _, code := sh(t, e.p, id, "exit 42"); code != 42 {
		t.Errorf("exit code %d", code)
	}
	// A builtin name is a program here, as with execve.
	if res, err := e.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"exit", "3"}}); err != nil || res.ExitCode != 127 {
		t.Errorf("argv[0] is run as a program: %+v %v", res, err)
	}
	var out bytes.Buffer
	in := strings.Repeat("stdin line\n", 5000)
	if res, err := e.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"wc", "-l"}, Stdin: strings.NewReader(in), Stdout: &out}); err != nil || res.ExitCode != 0 || strings.TrimSpace(out.String()) != "5000" {
		t.Errorf("stdin: %+v %v %q", res, err, out.String())
	}
	if out, _, _ := sh(t, e.p, id, `ls -a /tmp | grep -c stasis-stdin || true`); out != "0\n" {
		t.Errorf("stdin files left in /tmp: %q", out)
	}
	res, err := e.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", "echo started; echo oops >&2"}, Background: true, LogPath: "/tmp/logs/bg.log"})
	if err != nil || res.PID <= 0 {
		t.Fatalf("background: %+v %v", res, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := e.p.ReadFile(ctx, id, "/tmp/logs/bg.log")
		if err == nil && string(b) == "started\noops\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("background log: %q %v", b, err)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	_, err = e.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sleep", "30"}, Timeout: 200 * time.Millisecond})
	if !errors.Is(err, errdefs.ErrTimeout) || !strings.Contains(err.Error(), id) {
		t.Errorf("timeout: %v", err)
	}
	// Files: a mode of 0, a relative path (to the work directory).
	if err := e.p.WriteFile(ctx, id, "rel/none.txt", []byte("x"), 0); err != nil {
		t.Fatal(err)
	}
	if out, _, _ := sh(t, e.p, id, `stat -c %a /work/rel/none.txt`); out != "0\n" {
		t.Errorf("mode 0 file: %q", out)
	}
}

func trunc(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}

// TestSeedRoot: Spec.Root lands in the work directory, modes and symlinks
// kept.
func TestSeedRoot(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "d", "empty"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "d", "run.sh"), []byte("#!/bin/sh\necho ran\n"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("d/run.sh", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	info, err := e.p.Create(ctx, sandbox.Spec{Root: root, Expiry: time.Now().Add(time.Hour), Labels: map[string]string{"odd": "a/b_c -"}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.p.Delete(ctx, info.ID)
	if out, _, _ := sh(t, e.p, info.ID, `./link; stat -c %a d/run.sh; test -d d/empty && echo dir`); out != "ran\n750\ndir\n" {
		t.Fatalf("seeded tree: %q", out)
	}
	got, err := e.p.Get(ctx, info.ID)
	if err != nil || got.Labels["odd"] != "a/b_c -" {
		t.Fatalf("label with characters metadata refuses: %+v %v", got.Labels, err)
	}
	if l, err := e.p.List(ctx, map[string]string{"odd": "a/b_c -"}); err != nil || len(l) != 1 {
		t.Fatalf("list by it: %+v %v", l, err)
	}
}

// recorder is a fault that changes nothing and records every request it
// matches.
func recorder(method, path string) *osfake.Fault { return &osfake.Fault{Method: method, Path: path} }

func TestRetryAfterHonoured(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	busy := &osfake.Fault{Method: "GET", Path: "/v1/sandboxes", Status: 429, RetryAfter: "1", Times: 1}
	all := recorder("GET", "/v1/sandboxes")
	removeBusy, removeAll := e.f.Inject(busy), e.f.Inject(all)
	if _, err := e.p.List(ctx, nil); err != nil {
		t.Fatal(err)
	}
	removeBusy()
	removeAll()
	b, a := busy.Hits(), all.Hits()
	if len(b) != 1 || len(a) != 1 {
		t.Fatalf("hits: 429 %d, then %d", len(b), len(a))
	}
	if gap := a[0].Sub(b[0]); gap < time.Second {
		t.Fatalf("retried %s after a 429 with Retry-After: 1", gap)
	}
	// A server that keeps answering 429: bounded, and said plainly.
	p := e.provider(t, opensandbox.Options{MaxAttempts: 3})
	always := &osfake.Fault{Method: "GET", Path: "/v1/sandboxes", Status: 429, RetryAfter: "0"}
	defer e.f.Inject(always)()
	_, err := p.List(ctx, nil)
	if err == nil || !strings.Contains(err.Error(), "429") || !strings.Contains(err.Error(), "3 attempts") {
		t.Fatalf("429 after every try: %v", err)
	}
	if n := len(always.Hits()); n != 3 {
		t.Fatalf("%d tries, want 3", n)
	}
}

func TestServerErrorRetriedThenSurfaced(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{MaxAttempts: 3})
	transient := &osfake.Fault{Method: "GET", Path: "/v1/sandboxes", Status: 500, Times: 2}
	remove := e.f.Inject(transient)
	if _, err := e.p.List(ctx, nil); err != nil {
		t.Fatalf("two 500s then an answer: %v", err)
	}
	remove()
	broken := &osfake.Fault{Method: "GET", Path: "/v1/sandboxes/sb-x", Status: 500}
	defer e.f.Inject(broken)()
	_, err := e.p.Get(ctx, "sb-x")
	if err == nil || !strings.Contains(err.Error(), "500") || !strings.Contains(err.Error(), "sb-x") || !strings.Contains(err.Error(), "3 attempt") {
		t.Fatalf("500 every time: %v", err)
	}
	if n := len(broken.Hits()); n != 3 {
		t.Fatalf("%d tries, want 3", n)
	}
	// A create is not idempotent: a 500 is not tried again.
	failCreate := &osfake.Fault{Method: "POST", Path: "/v1/sandboxes", Status: 500, Times: 1}
	defer e.f.Inject(failCreate)()
	if _, err := e.p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)}); err == nil || len(failCreate.Hits()) != 1 {
		t.Fatalf("create after a 500: %v, %d tries", err, len(failCreate.Hits()))
	}
}

func TestSlowAnswerRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{RequestTimeout: 300 * time.Millisecond})
	slow := &osfake.Fault{Method: "GET", Path: "/v1/sandboxes", Delay: 5 * time.Second, Times: 1}
	defer e.f.Inject(slow)()
	t0 := time.Now()
	if _, err := e.p.List(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if len(slow.Hits()) != 1 || time.Since(t0) > 4*time.Second {
		t.Fatalf("slow answer: %d hits, %s", len(slow.Hits()), time.Since(t0))
	}
	// Slow but within the timeout: just slow.
	lag := &osfake.Fault{Method: "GET", Path: "/v1/sandboxes", Delay: 50 * time.Millisecond, Times: 1}
	defer e.f.Inject(lag)()
	if _, err := e.p.List(ctx, nil); err != nil || len(lag.Hits()) != 1 {
		t.Fatal(err)
	}
}

func TestUnauthorized(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	for _, key := range []string{"wrong-key", ""} {
		p, err := opensandbox.New(opensandbox.Options{URL: e.url, APIKey: key})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		_, err = p.Get(ctx, "sb-1")
		if !errors.Is(err, opensandbox.ErrUnauthorized) || !strings.Contains(err.Error(), "OPENSANDBOX_API_KEY") || !strings.Contains(err.Error(), "401") {
			t.Errorf("key %q: %v", key, err)
		}
	}
}

func TestNotFoundTyped(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	checks := map[string]error{}
	_, checks["get"] = e.p.Get(ctx, "no-such")
	_, checks["exec"] = e.p.Exec(ctx, "no-such", sandbox.ExecRequest{Argv: []string{"true"}})
	_, checks["read"] = e.p.ReadFile(ctx, "no-such", "/x")
	_, checks["get-snapshot"] = e.p.GetSnapshot(ctx, "no-such")
	_, checks["fork"] = e.p.Fork(ctx, "no-such", 1, sandbox.ForkSpec{Expiry: time.Now().Add(time.Hour)})
	checks["set-expiry"] = e.p.SetExpiry(ctx, "no-such", time.Now().Add(time.Hour))
	for op, err := range checks {
		if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "no-such") {
			t.Errorf("%s: %v", op, err)
		}
	}
	if err := e.p.Delete(ctx, "no-such"); err != nil {
		t.Errorf("delete of nothing: %v", err)
	}
	if err := e.p.DeleteSnapshot(ctx, "no-such"); err != nil {
		t.Errorf("delete-snapshot of nothing: %v", err)
	}
}

func TestStuckSnapshot(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{SnapshotTimeout: 500 * time.Millisecond})
	id := e.create(t).ID
	undo := e.f.StickSnapshots(id)
	_, err := e.p.Snapshot(ctx, id, "stuck")
	var se *sandbox.Error
	if !errors.Is(err, errdefs.ErrTimeout) || !errors.As(err, &se) || !strings.Contains(err.Error(), "Creating") || !strings.HasPrefix(se.What, "snapshot ") {
		undo()
		t.Fatalf("stuck snapshot: %v", err)
	}
	snap := strings.Fields(se.What)[1]
	if err := e.p.DeleteSnapshot(ctx, snap); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("delete while Creating: %v", err)
	}
	if _, err := e.p.GetSnapshot(ctx, snap); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("get while Creating: %v", err)
	}
	undo()
	if got, err := e.p.GetSnapshot(ctx, snap); err != nil || got.ID != snap || got.Name != "stuck" || got.Sandbox != id {
		t.Fatalf("after it came loose: %+v %v", got, err)
	}
	if err := e.p.DeleteSnapshot(ctx, snap); err != nil {
		t.Fatal(err)
	}
}

func TestVanishedSandbox(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	info, err := e.p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, e.p, info.ID, "true") // the endpoint is known
	if err := e.f.Vanish(info.ID); err != nil {
		t.Fatal(err)
	}
	_, err = e.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "before its expiry") || !strings.Contains(err.Error(), info.ID) {
		t.Fatalf("exec in a vanished sandbox: %v", err)
	}
	if _, err := e.p.Get(ctx, info.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get: %v", err)
	}
	if err := e.p.Delete(ctx, info.ID); err != nil {
		t.Fatal(err)
	}
}

func TestPauseResume(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{TransitionDelay: 200 * time.Millisecond}, opensandbox.Options{})
	id := e.create(t).ID
	bg, err := e.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sleep", "600"}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	procState := func() string {
		var out bytes.Buffer
		_, err := e.backend.Exec(ctx, e.f.BackendID(id), sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", fmt.Sprintf("cut -d' ' -f3 /proc/%d/stat", bg.PID)}, Stdout: &out})
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(out.String())
	}
	polls := recorder("GET", "/v1/sandboxes/"+id)
	remove := e.f.Inject(polls)
	t0 := time.Now()
	if err := e.p.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	remove()
	if time.Since(t0) < 200*time.Millisecond || len(polls.Hits()) < 2 {
		t.Fatalf("pause returned after %s and %d polls, before Paused", time.Since(t0), len(polls.Hits()))
	}
	if got, err := e.p.Get(ctx, id); err != nil || got.State != "paused" {
		t.Fatalf("after pause: %+v %v", got, err)
	}
	if st := procState(); st != "T" {
		t.Fatalf("a process in the paused sandbox is %q, not stopped", st)
	}
	if _, err := e.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "resume") {
		t.Fatalf("exec while paused: %v", err)
	}
	if err := e.p.Pause(ctx, id); err != nil {
		t.Fatalf("pause again: %v", err)
	}
	if err := e.p.SetExpiry(ctx, id, time.Now().Add(20*time.Minute)); err != nil {
		t.Fatalf("expiry of a paused sandbox: %v", err)
	}
	if err := e.p.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	if st := procState(); st == "T" {
		t.Fatal("still stopped after resume")
	}
	if out, _, _ := sh(t, e.p, id, "echo back"); out != "back\n" {
		t.Fatalf("after resume: %q", out)
	}
}

// TestServerExpiry: stasis's expiry moves both ways; the server's own is
// renewed, with absolute times, only past it.
func TestServerExpiry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	info, err := e.p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(2 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer e.p.Delete(ctx, info.ID)
	serverExpiry := func() time.Time {
		req, _ := http.NewRequest("GET", e.url+"/v1/sandboxes/"+info.ID, nil)
		req.Header.Set("OPEN-SANDBOX-API-KEY", apiKey)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var s struct {
			ExpiresAt time.Time `json:"expiresAt"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
			t.Fatal(err)
		}
		return s.ExpiresAt
	}
	first := serverExpiry()
	if d := time.Until(first); d < 2*time.Minute || d > 4*time.Minute {
		t.Fatalf("server expiry %s from now", d)
	}
	renews := recorder("POST", "/v1/sandboxes/"+info.ID+"/renew-expiration")
	defer e.f.Inject(renews)()
	later := time.Now().Add(3 * time.Hour)
	if err := e.p.SetExpiry(ctx, info.ID, later); err != nil {
		t.Fatal(err)
	}
	if s := serverExpiry(); s.Before(later) || len(renews.Hits()) != 1 {
		t.Fatalf("server expiry %s after setting %s (%d renewals)", s, later, len(renews.Hits()))
	}
	sooner := time.Now().Add(time.Hour)
	if err := e.p.SetExpiry(ctx, info.ID, sooner); err != nil {
		t.Fatal(err)
	}
	got, err := e.p.Get(ctx, info.ID)
	if err != nil || got.Expiry.Before(sooner) || got.Expiry.After(sooner.Add(time.Millisecond)) || len(renews.Hits()) != 1 {
		t.Fatalf("stasis expiry %s, want %s (%d renewals): %v", got.Expiry, sooner, len(renews.Hits()), err)
	}
	// Another process sees the same expiry.
	other := e.provider(t, opensandbox.Options{})
	if got2, err := other.Get(ctx, info.ID); err != nil || !got2.Expiry.Equal(got.Expiry) {
		t.Fatalf("from another provider: %+v %v", got2, err)
	}
}

// TestForkFailureCleansUp: a fork whose sandbox fails on the server
// deletes the others and names the failure.
func TestForkFailureCleansUp(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	id := e.create(t).ID
	snap, err := e.p.Snapshot(ctx, id, "")
	if err != nil {
		t.Fatal(err)
	}
	defer e.p.DeleteSnapshot(ctx, snap.ID)
	undo := e.f.FailFork(snap.ID, 0)
	_, err = e.p.Fork(ctx, snap.ID, 2, sandbox.ForkSpec{Labels: map[string]string{"f": "x"}, Expiry: time.Now().Add(time.Hour)})
	undo()
	if err == nil || !strings.Contains(err.Error(), "injected provisioning failure") || !strings.Contains(err.Error(), "of 2 failed") {
		t.Fatalf("fork: %v", err)
	}
	if left, err := e.p.List(ctx, map[string]string{"f": "x"}); err != nil || len(left) != 0 {
		t.Fatalf("left: %+v %v", left, err)
	}
}

// TestListPagination: listing follows the pages, and filters by label.
func TestListPagination(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{PageSize: 2})
	want := map[string]bool{}
	for i := 0; i < 5; i++ {
		info, err := e.p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour), Labels: map[string]string{"set": "pages", "i": fmt.Sprint(i)}})
		if err != nil {
			t.Fatal(err)
		}
		defer e.p.Delete(ctx, info.ID)
		want[info.ID] = true
	}
	pages := recorder("GET", "/v1/sandboxes")
	remove := e.f.Inject(pages)
	list, err := e.p.List(ctx, map[string]string{"set": "pages"})
	remove()
	if err != nil || len(list) != 5 || len(pages.Hits()) != 3 {
		t.Fatalf("listed %d in %d pages: %v", len(list), len(pages.Hits()), err)
	}
	for i, in := range list {
		if !want[in.ID] || i > 0 && in.Created.Before(list[i-1].Created) {
			t.Fatalf("list %+v", list)
		}
	}
	if one, err := e.p.List(ctx, map[string]string{"set": "pages", "i": "3"}); err != nil || len(one) != 1 || one[0].Labels["i"] != "3" {
		t.Fatalf("by two labels: %+v %v", one, err)
	}
}

// TestServerProxy: execd reached through the server's proxy route.
func TestServerProxy(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	p := e.provider(t, opensandbox.Options{UseServerProxy: true})
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour), Files: map[string][]byte{"/work/f": []byte("via proxy")}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, info.ID)
	proxied := recorder("", "/sandboxes/"+info.ID+"/proxy/")
	defer e.f.Inject(proxied)()
	if b, err := p.ReadFile(ctx, info.ID, "/work/f"); err != nil || string(b) != "via proxy" || len(proxied.Hits()) != 1 {
		t.Fatalf("read through the proxy: %q %v (%d proxied)", b, err, len(proxied.Hits()))
	}
}

// TestGC: a sandbox past stasis's expiry whose process is gone is deleted
// by GC (and any call on it says it expired).
func TestGC(t *testing.T) {
	t.Parallel()
	e := newEnv(t, osfake.Options{}, opensandbox.Options{})
	info := e.create(t)
	gone := e.provider(t, opensandbox.Options{})
	if err := gone.SetExpiry(ctx, info.ID, time.Now().Add(300*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	_ = gone.Close() // its timer would have deleted it
	deadline := time.Now().Add(10 * time.Second)
	p := e.provider(t, opensandbox.Options{})
	for {
		reaped, err := p.GC(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(reaped) == 1 && reaped[0] == info.ID {
			break
		}
		if len(reaped) != 0 || time.Now().After(deadline) {
			t.Fatalf("gc reaped %v", reaped)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if _, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, errdefs.ErrExpired) {
		t.Fatalf("exec after gc: %v", err)
	}
	if e.f.Retired(info.ID) != 1 {
		t.Fatalf("retired %d times", e.f.Retired(info.ID))
	}
}
