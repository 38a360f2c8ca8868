package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/control/serve"
	"stasis/internal/control/server"
	"stasis/internal/control/task"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
	"stasis/internal/testwait"
)

// holder holds every model request that is the third call of its
// conversation (two assistant messages before it) until released.
type holder struct {
	next     http.Handler
	arrived  chan struct{}
	release  chan struct{}
	arriveMu sync.Once
	relMu    sync.Once
}

func (h *holder) Release() { h.relMu.Do(func() { close(h.release) }) }

func (h *holder) ServeHTTP(w http.ResponseWriter, q *http.Request) {
	body, err := io.ReadAll(q.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req struct {
		Messages []struct {
			Role string `json:"role"`
		} `json:"messages"`
	}
	if json.Unmarshal(body, &req) == nil {
		assistant := 0
		for _, m := range req.Messages {
			if m.Role == "assistant" {
				assistant++
			}
		}
		if assistant == 2 {
			h.arriveMu.Do(func() { close(h.arrived) })
			select {
			case <-h.release:
			case <-q.Context().Done(): // the gateway that asked is gone
				return
			}
		}
	}
	q.Body = io.NopCloser(bytes.NewReader(body))
	h.next.ServeHTTP(w, q)
}

// serveProc is a `stasis serve` child (stasistest.Serve) for one test.
type serveProc struct {
	*stasistest.Serve
	t *testing.T
}

// startServe starts `stasis serve --state state ARGS...`.
func startServe(t *testing.T, state string, args ...string) *serveProc {
	t.Helper()
	s := stasistest.StartServeT(t, stasistest.ServeOptions{Env: []string{"GORACE=atexit_sleep_ms=0"}, Log: filepath.Join(t.TempDir(), "serve.log")},
		append([]string{"--state", state}, args...)...)
	return &serveProc{Serve: s, t: t}
}

func (p *serveProc) logTail() string { return p.LogTail(30) }

func (p *serveProc) api() *client { return &client{t: p.t, base: "http://" + p.Addr} }

// kill ends the server with SIGKILL, as a crash would.
func (p *serveProc) kill() { p.Kill() }

// stop ends the server with SIGTERM and expects exit 0.
func (p *serveProc) stop() {
	p.t.Helper()
	if err := p.Stop(30 * time.Second); err != nil {
		p.t.Fatal(err)
	}
}

// processesUnder lists the processes whose command line names dir.
func processesUnder(dir string) []string {
	var found []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !bytes.Contains(b, []byte(dir)) {
			continue
		}
		found = append(found, e.Name()+": "+strings.ReplaceAll(string(bytes.TrimRight(b, "\x00")), "\x00", " "))
	}
	return found
}

// A real `stasis serve`, killed with SIGKILL while an episode's third model
// call is held at the model, and started again on the same state
// directory, reconnects to the episode (its sandbox ran on); the held call
// goes through to the new server's gateway, the episode ends, and it
// verifies with reward 1. Retired through the API and the server stopped
// with SIGTERM, nothing of it is left.
func TestRestart(t *testing.T) {
	start := time.Now()
	lap := func(what string) { t.Logf("%6.1fs %s", time.Since(start).Seconds(), what) }
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)

	ts, err := task.Builtin()
	if err != nil {
		t.Fatal(err)
	}
	scripts, err := task.Scripts(ts)
	if err != nil {
		t.Fatal(err)
	}
	h := &holder{next: model.New(model.Options{Scripts: scripts}), arrived: make(chan struct{}), release: make(chan struct{})}
	msrv := httptest.NewServer(h)
	defer msrv.Close()
	defer h.Release() // before the model server closes

	s1 := startServe(t, state, "--model-upstream", msrv.URL, "--log-level", "debug")
	api := s1.api()
	lap("server 1 up")
	var v view
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-r", "task": "py-ini-value-with-equals", "harness": "mini"}, http.StatusCreated, &v)
	sandboxID := v.Sandbox
	select {
	case <-h.arrived:
	case <-ctx.Done():
		t.Fatalf("the third model call never came; the server's log:\n%s", s1.logTail())
	}
	if v = api.episode("ep-r"); !v.Live || v.Status == nil || v.Status.State != "running" || v.ModelCalls != 2 {
		t.Fatalf("ep-r held at its third call: %+v", v)
	}
	lap("third call held")

	s1.kill()
	lap("server 1 killed")
	s2 := startServe(t, state, "--model-upstream", msrv.URL, "--log-level", "debug")
	api = s2.api()
	lap("server 2 up")
	v = api.episode("ep-r")
	if !v.Live || v.State != store.EpisodeRunning || v.Sandbox != sandboxID || v.Status == nil || v.Status.State != "running" {
		t.Fatalf("ep-r after the restart: %+v; the server's log:\n%s", v, s2.logTail())
	}

	h.Release()
	api.waitExited(ctx, "ep-r")
	lap("ep-r exited")
	api.verify("ep-r", false)
	api.verify("ep-r", true)
	if v = api.episode("ep-r"); !v.LedgerOK || v.ModelCalls < 3 || v.Reward == nil || *v.Reward != 1 || v.Attempt != 0 {
		t.Fatalf("ep-r at the end: %+v", v)
	}
	api.call("POST", "/v1/episodes/ep-r/retire", nil, http.StatusOK, &v)
	if v.State != store.EpisodeRetired || v.Live {
		t.Fatalf("ep-r after retire: %+v", v)
	}
	s2.stop()
	lap("server 2 stopped")
	if sock, _ := server.GatewaySocket(state); dirExists(filepath.Dir(sock)) {
		t.Errorf("%s is left after the last sandbox and the server", filepath.Dir(sock))
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		left := processesUnder(state)
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes of the state directory left: %v", left)
		}
		time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// The command line refuses what it cannot serve, and its help shows a curl
// session.
func TestServeUsage(t *testing.T) {
	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"serve", "--state", t.TempDir()}, "--listen is required"},
		{[]string{"serve", "--listen", "127.0.0.1:0"}, "--state is required"},
		{[]string{"serve", "--listen", "127.0.0.1:0", "--state", t.TempDir(), "--concurrency", "0"}, "--concurrency"},
		{[]string{"serve", "--listen", "127.0.0.1:0", "--state", t.TempDir(), "--tasks", filepath.Join(t.TempDir(), "none")}, "tasks"},
	} {
		_, errOut, code := stasistest.Run(t, nil, "", c.args...)
		if code != 2 || !strings.Contains(errOut, c.says) {
			t.Errorf("%v: exit %d, %q; want 2 saying %q", c.args, code, errOut, c.says)
		}
	}
	out, _, code := stasistest.Run(t, nil, "", "serve", "--help")
	if code != 0 || !strings.Contains(out, "curl -s --json '{\"id\":\"ep-1\"") {
		t.Errorf("serve --help: exit %d:\n%s", code, out)
	}
}

// A SIGTERM that comes while `stasis serve` is starting (here: held by a
// step gate just before it prints its address) ends it in order once it
// has started, exit 0, never by the signal's default action, which would
// leave its sandboxes running with nothing driving them.
func TestSigtermWhileStarting(t *testing.T) {
	state := t.TempDir()
	cleanState(t, state)
	gate := t.TempDir()
	logPath := filepath.Join(t.TempDir(), "serve.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(stasistest.Exe(), "serve", "--state", state, "--listen", "127.0.0.1:0")
	cmd.Env = append(append(os.Environ(), stasistest.Env...), "GORACE=atexit_sleep_ms=0",
		serve.StepGateEnv+"="+gate, serve.StepGateAtEnv+"=serve:listening")
	cmd.Stderr, cmd.Stdout = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		select {
		case <-done:
		default:
			_ = cmd.Process.Kill()
			<-done
		}
	})
	reached := filepath.Join(gate, "1-serve-listening-.reached")
	testwait.Until(t, "stasis serve to reach its gate before it listens", 2*time.Minute, func() bool {
		if _, err := os.Stat(reached); err == nil {
			return true
		}
		select {
		case <-done:
			log, _ := os.ReadFile(logPath)
			t.Fatalf("stasis serve exited before its gate; its log:\n%s", log)
		default:
		}
		return false
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(strings.TrimSuffix(reached, ".reached")+".go", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("stasis serve still runs 30s after SIGTERM")
	}
	log, _ := os.ReadFile(logPath)
	if code := cmd.ProcessState.ExitCode(); code != 0 || !strings.Contains(string(log), "shutting down") {
		t.Fatalf("stasis serve, SIGTERM while it started: exit %d (-1: killed by the signal); its log:\n%s", code, log)
	}
}
