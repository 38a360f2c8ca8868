package clients

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/control/relay"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/internal/testwait"
)

// codexVersion is the Codex CLI the Makefile pins; the config keys below
// are the ones it knows (the run uses --strict-config, so a key it does not
// know fails the run instead of being ignored).
const codexVersion = "0.171.0"

// codexBin is the Codex CLI `make deps-clients` installs: npm's launcher,
// which starts the native binary of the platform package beside it.
func codexBin(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(moduleRoot(t), npmPrefix, "node_modules/.bin/codex")
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("the Codex CLI is not installed (%v): run `make deps-clients`, which installs @openai/codex %s into .tools/npm", err, codexVersion)
	}
	return bin
}

// codexScript is the conversation the scripted model plays with Codex.
// Codex 0.171 offers its shell as the function tool exec_command, whose
// argument "cmd" is a shell command line (it runs it with the user's shell,
// as a login shell, in the turn's working directory). The two commands
// leave traces in the work directory that the test checks.
func codexScript(t *testing.T) *model.Script {
	t.Helper()
	s, err := model.ParseScript([]byte(`{"name": "codex", "turns": [
	  {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "printf 'hello from codex\\n' > note.txt"}}]},
	  {"content": "Checking the note.",
	   "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "cat note.txt > seen.txt && ls > listing.txt"}}]},
	  {"content": "note.txt says hello from codex; the listing is in listing.txt."}
	]}`))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

const codexFinal = "note.txt says hello from codex; the listing is in listing.txt."

// codexConfig is CODEX_HOME/config.toml for a run against baseURL.
//
//   - model, model_provider and [model_providers.stasis]: the scripted model
//     behind a custom provider speaking the Responses API (wire_api =
//     "responses", the only one 0.171 accepts) at base_url, its key read
//     from the environment variable env_key names (a dummy: the relay
//     ignores the harness's key and sends the episode's own token). No
//     retries: a failed call must fail the test, not be hidden by a second
//     attempt (the relay retries upstream failures itself).
//   - approval_policy = "never": exec must not stop to ask.
//   - sandbox_mode = "danger-full-access": Codex's own command sandbox off.
//     It cannot run here: its bundled bubblewrap execs a helper,
//     codex-linux-sandbox, that Codex puts on PATH as an alias it creates
//     under CODEX_HOME, and it refuses to create helpers under a
//     temporary directory, which CODEX_HOME (t.TempDir) is; every command
//     then fails with "bwrap: execvp codex-linux-sandbox: No such file or
//     directory". The test's commands only touch its work directory.
//   - check_for_update_on_startup = false, [analytics] and [feedback]
//     disabled: nothing reports home.
//   - web_search = "disabled": the model is offered no web search tool.
//   - [features] plugins, remote_plugin and apps off: with them on, Codex
//     0.171 syncs its curated plugins at start (git ls-remote of
//     github.com/openai/plugins, then api.github.com, then
//     chatgpt.com/backend-api/plugins/export/curated).
func codexConfig(baseURL string) string {
	return fmt.Sprintf(`model = "stasis-scripted"
model_provider = "stasis"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
web_search = "disabled"

[features]
plugins = false
remote_plugin = false
apps = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.stasis]
name = "stasis relay"
base_url = %q
env_key = "STASIS_CODEX_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
`, baseURL)
}

// codexRun is one `codex exec` set up in temporary directories: its home
// (CODEX_HOME and HOME), the work directory it acts in, and a proxy trap.
type codexRun struct {
	bin, home, work, lastMsg string
	env                      []string
	proxy                    *trap
}

func newCodexRun(t *testing.T, baseURL string) *codexRun {
	t.Helper()
	c := &codexRun{bin: codexBin(t), home: t.TempDir(), work: t.TempDir(), proxy: newTrap(t)}
	c.lastMsg = filepath.Join(c.home, "last-message.txt")
	if err := os.WriteFile(filepath.Join(c.home, "config.toml"), []byte(codexConfig(baseURL)), 0o600); err != nil {
		t.Fatal(err)
	}
	// Every proxy variable points at the trap, so whatever Codex would
	// fetch from outside shows up there instead of failing unseen; the
	// model's address is loopback and exempt.
	c.env = []string{
		"CODEX_HOME=" + c.home, "HOME=" + c.home, "STASIS_CODEX_KEY=dummy-key",
		"HTTP_PROXY=" + c.proxy.url, "HTTPS_PROXY=" + c.proxy.url, "ALL_PROXY=" + c.proxy.url,
		"http_proxy=" + c.proxy.url, "https_proxy=" + c.proxy.url, "all_proxy=" + c.proxy.url,
		"NO_PROXY=127.0.0.1,localhost", "no_proxy=127.0.0.1,localhost",
	}
	c.checkVersion(t)
	return c
}

func (c *codexRun) checkVersion(t *testing.T) {
	t.Helper()
	cmd := exec.Command(c.bin, "--version")
	cmd.Env = append(os.Environ(), c.env...)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), codexVersion) {
		t.Fatalf("%s --version: %q (%v); want %s: run `make deps-clients`", c.bin, out, err, codexVersion)
	}
}

// argv is the command line of `codex exec`: non-interactive, with no git
// repository, acting in the work directory, rejecting config keys this
// version does not know, writing its final message to a file as well.
func (c *codexRun) argv(prompt string) []string {
	return []string{c.bin, "exec", "--strict-config", "--skip-git-repo-check", "--color", "never",
		"-C", c.work, "-o", c.lastMsg, prompt}
}

// checkWork checks the traces the script's two commands leave and the
// final message Codex wrote.
func (c *codexRun) checkWork(t *testing.T, stdout string) {
	t.Helper()
	for name, want := range map[string]string{"note.txt": "hello from codex\n", "seen.txt": "hello from codex\n"} {
		b, err := os.ReadFile(filepath.Join(c.work, name))
		if err != nil || string(b) != want {
			t.Errorf("%s: %q (%v), want %q", name, b, err, want)
		}
	}
	if b, err := os.ReadFile(filepath.Join(c.work, "listing.txt")); err != nil || !strings.Contains(string(b), "note.txt") {
		t.Errorf("listing.txt: %q (%v), want a listing naming note.txt", b, err)
	}
	if b, err := os.ReadFile(c.lastMsg); err != nil || strings.TrimSpace(string(b)) != codexFinal {
		t.Errorf("codex's last message file: %q (%v), want %q", b, err, codexFinal)
	}
	if !strings.Contains(stdout, codexFinal) {
		t.Errorf("codex's stdout does not hold its final message %q:\n%s", codexFinal, stdout)
	}
	c.proxy.none(t)
}

// trap is an HTTP proxy on loopback that refuses everything and records
// what was asked of it.
type trap struct {
	url string
	mu  sync.Mutex
	got []string
}

func newTrap(t *testing.T) *trap {
	p := &trap{}
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.got = append(p.got, r.Method+" "+r.Host+r.URL.RequestURI())
		p.mu.Unlock()
		http.Error(w, "no network in this test", http.StatusBadGateway)
	}))
	t.Cleanup(s.Close)
	p.url = s.URL
	return p
}

func (p *trap) none(t *testing.T) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.got) > 0 {
		t.Errorf("codex tried to reach the network: %q", p.got)
	}
}

// calls records the requests that reach the model.
type calls struct {
	mu    sync.Mutex
	reqs  []string // "METHOD PATH"
	first []byte   // the first request's body
}

func (c *calls) add(r *http.Request, body []byte) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reqs = append(c.reqs, r.Method+" "+r.URL.Path)
	if c.first == nil {
		c.first = body
	}
	return len(c.reqs)
}

func (c *calls) list() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.reqs)
}

func (c *calls) count() int { return len(c.list()) }

// logFirst logs the tools and input items of the first request the model
// got, once: what Codex offers the model and how its conversation starts;
// where says who sent it.
func (c *calls) logFirst(t *testing.T, where string) {
	t.Helper()
	c.mu.Lock()
	b := c.first
	c.mu.Unlock()
	var req struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
		Store  *bool  `json:"store"`
		Tools  []struct {
			Type, Name string
		} `json:"tools"`
		Input []struct {
			Type, Role string
		} `json:"input"`
	}
	if err := json.Unmarshal(b, &req); err != nil {
		t.Fatalf("codex's first request is not JSON: %v: %.200q", err, b)
	}
	var tools, items []string
	for _, x := range req.Tools {
		tools = append(tools, x.Type+":"+x.Name)
	}
	for _, x := range req.Input {
		items = append(items, x.Type+":"+x.Role)
	}
	t.Logf("the model's first request (%s): model %q, stream %v, %d bytes; tools %v; input %v", where, req.Model, req.Stream, len(b), tools, items)
	if !slices.Contains(tools, "function:exec_command") {
		t.Fatalf("codex offers no exec_command tool (the script's shell calls need it): %v", tools)
	}
}

// scriptedModel serves the script, recording every request; gate, when
// set, runs before a request is answered, with its number.
func scriptedModel(t *testing.T, rec *calls, gate func(n int, r *http.Request)) *httptest.Server {
	m := model.New(model.Options{Script: codexScript(t)})
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		n := rec.add(r, body)
		if gate != nil {
			gate(n, r)
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		m.ServeHTTP(w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

// TestCodexDirect runs codex exec against the scripted model with no relay
// between them: the baseline for the run through the relay.
func TestCodexDirect(t *testing.T) {
	t.Parallel()
	var rec calls
	m := scriptedModel(t, &rec, nil)
	c := newCodexRun(t, m.URL+"/v1")
	argv := c.argv("Write hello into note.txt, then check it.")
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), c.env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("codex exec: %v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errb.String())
		}
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("codex exec did not finish within 60s\nstdout:\n%s\nstderr:\n%s", out.String(), errb.String())
	}
	rec.logFirst(t, "codex, directly")
	c.checkWork(t, out.String())
	want := []string{"POST /v1/responses", "POST /v1/responses", "POST /v1/responses"}
	if got := rec.list(); !slices.Equal(got, want) {
		t.Errorf("codex called the model %q, want %q", got, want)
	}
	if t.Failed() {
		t.Logf("codex stderr:\n%s", errb.String())
	}
}

// TestCodexHoldPauseThroughRelay runs codex exec under a real supervisor
// (this test binary acting as stasis) whose relay it calls, with the
// gateway and the scripted model in this process. The model's second
// answer is held back until the supervisor has paused in hold mode: the
// acknowledgement counts the one response Codex has, as the ledger does;
// the second answer, once recorded, is not delivered while the pause
// lasts; after the continue Codex finishes its work, and the relay's
// deliveries, the ledger and the model's calls all count three.
func TestCodexHoldPauseThroughRelay(t *testing.T) {
	t.Parallel()
	const episode = "ep-codex"
	inFlight := make(chan struct{})
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	var rec calls
	m := scriptedModel(t, &rec, func(n int, r *http.Request) {
		if n != 2 {
			return
		}
		close(inFlight)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})

	g, err := relay.OpenGateway(relay.GatewayConfig{Upstream: m.URL, State: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Close() })
	gw := httptest.NewServer(g.Handler())
	t.Cleanup(gw.Close)
	// Before the servers' Close (cleanups run last first): a failing test
	// must not leave the model's handler waiting, nor the gateway's on it.
	t.Cleanup(unblock)
	ep, err := g.AddEpisode(episode)
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	tok := filepath.Join(work, "token.json")
	b, _ := json.Marshal(ep.Credentials(0))
	if err := os.WriteFile(tok, b, 0o600); err != nil {
		t.Fatal(err)
	}
	relayAddr := stasistest.FreeLoopbackAddr(t)
	relayURL := "http://" + relayAddr
	c := newCodexRun(t, relayURL+"/v1")

	// The harness: codex exec, its output to files; then it waits on a
	// FIFO until the test has read the relay's final count with a second
	// pause, and exits with codex's code. The test holds the FIFO's one
	// writer from the start (so the harness's open does not wait), and
	// closing it is the harness's end of file.
	stdout, stderr := filepath.Join(work, "codex.out"), filepath.Join(work, "codex.err")
	rcFile, fifo := filepath.Join(work, "codex.rc"), filepath.Join(work, "finish")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	writer, err := os.OpenFile(fifo, os.O_RDWR, 0) // on Linux, opens a FIFO without waiting
	if err != nil {
		t.Fatal(err)
	}
	finish := func() { _ = writer.Close() }
	script := `out=$1 err=$2 rc=$3 fifo=$4; shift 4
exec 3< "$fifo"
"$@" > "$out" 2> "$err" < /dev/null 3<&-
code=$?
echo $code > "$rc.tmp" && mv "$rc.tmp" "$rc"
read _ <&3
exit $code`
	argv := append([]string{"env"}, c.env...)
	argv = append(argv, "/bin/sh", "-c", script, "harness", stdout, stderr, rcFile, fifo)
	argv = append(argv, c.argv("Write hello into note.txt, then check it.")...)
	dir := filepath.Join(t.TempDir(), "session")
	h, err := supervisor.Spawn(context.Background(), supervisor.SpawnOptions{
		Exe: stasistest.Exe(), Env: stasistest.Env, Dir: dir,
		Flags: []string{"--log-level", "warn", "--mode", "hold",
			"--relay-listen", relayAddr, "--relay-upstream", gw.URL, "--relay-token-file", tok},
		Argv: argv, Stdout: os.Stderr, Stderr: os.Stderr,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stopSupervisor(t, h, finish) })
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("STASIS_TEST_SHOW_CODEX") != "" {
			for _, f := range []string{stdout, stderr} {
				b, _ := os.ReadFile(f)
				t.Logf("%s:\n%s", filepath.Base(f), b)
			}
		}
	})

	select {
	case <-inFlight:
	case <-h.Done():
		t.Fatal("the supervisor ended before codex's second model call")
	case <-time.After(60 * time.Second):
		t.Fatalf("codex's second model call did not reach the model within 60s (model calls: %q)", rec.list())
	}

	// Pause while the second call is in flight.
	ack := call(t, h, supervisor.OpPause, 1).Ack
	if ack == nil || ack.Mode != "hold" || ack.RelayDelivered == nil {
		t.Fatalf("pause 1: want a hold acknowledgement with relay_delivered, got %+v", ack)
	}
	live := func() int64 {
		hist, err := ledger.ReadIn(g.Ledgers(), episode)
		if err != nil {
			t.Fatal(err)
		}
		return int64(len(hist.Entries))
	}
	t.Logf("pause 1: relay_delivered %d, ledger %d entries, model calls %d", *ack.RelayDelivered, live(), rec.count())
	if *ack.RelayDelivered != 1 || live() != 1 {
		t.Fatalf("pause 1 while the second call is in flight: relay_delivered %d, ledger %d entries; want 1 and 1", *ack.RelayDelivered, live())
	}
	if _, err := os.Stat(filepath.Join(c.work, "note.txt")); err != nil {
		t.Fatalf("codex got the first answer but did not run its command: %v", err)
	}

	// Let the model answer during the hold: the gateway records it, the
	// relay must not hand it to codex.
	unblock()
	testwait.Until(t, "the gateway records the second answer during the hold", 30*time.Second, func() bool { return live() == 2 })
	held := func() string {
		if d := metric(t, relayURL, "stasis_relay_delivered_total"); d != 1 {
			return fmt.Sprintf("the relay delivered %v responses", d)
		}
		if _, err := os.Stat(filepath.Join(c.work, "seen.txt")); err == nil {
			return "codex ran the second answer's command"
		}
		if n := rec.count(); n != 2 {
			return fmt.Sprintf("the model got %d calls", n)
		}
		return ""
	}
	// Observation window: nothing is delivered while the pause holds.
	for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); time.Sleep(testwait.Interval) {
		if what := held(); what != "" {
			t.Fatalf("during the hold (relay_delivered %d): %s", *ack.RelayDelivered, what)
		}
	}
	t.Logf("hold: ledger %d entries, relay delivered %v, relay held calls %v", live(),
		metric(t, relayURL, "stasis_relay_delivered_total"), metric(t, relayURL, "stasis_relay_held_calls"))

	call(t, h, supervisor.OpContinue, 1)
	testwait.Until(t, "codex exec ends", 60*time.Second, func() bool {
		_, err := os.Stat(rcFile)
		return err == nil
	})
	rcText, _ := os.ReadFile(rcFile)
	outText, _ := os.ReadFile(stdout)
	if rc := strings.TrimSpace(string(rcText)); rc != "0" {
		t.Fatalf("codex exec exited with %s", rc)
	}

	// Codex is done, the supervisor still up: a second pause reads the
	// relay's final count.
	ack2 := call(t, h, supervisor.OpPause, 2).Ack
	delivered := metric(t, relayURL, "stasis_relay_delivered_total")
	calledRelay := metric(t, relayURL, "stasis_relay_calls_total")
	call(t, h, supervisor.OpContinue, 2)
	finish()
	if err := h.Wait(30 * time.Second); err != nil {
		t.Fatalf("supervisor: %v", err)
	}
	rc, err := supervisor.ReadReceipt(dir)
	if err != nil {
		t.Fatal(err)
	}
	if rc.ReturnCode == nil || *rc.ReturnCode != 0 || !rc.CleanupConfirmed {
		t.Errorf("receipt: %+v", rc)
	}

	rec.logFirst(t, "codex's, as the relay forwards it")
	c.checkWork(t, string(outText))
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	rep, err := ledger.VerifyIn(g.Ledgers(), episode)
	if err != nil || !rep.OK {
		t.Fatalf("ledger verify: %+v %v", rep, err)
	}
	models := rec.list()
	t.Logf("end: relay_delivered %d (metrics: %v delivered, %v calls), ledger %d entries, model calls %q",
		*ack2.RelayDelivered, delivered, calledRelay, rep.Live, models)
	want := []string{"POST /v1/responses", "POST /v1/responses", "POST /v1/responses"}
	if !slices.Equal(models, want) {
		t.Errorf("the model got %q, want %q", models, want)
	}
	if *ack2.RelayDelivered != 3 || delivered != 3 || calledRelay != 3 || rep.Live != 3 || rep.Entries != 3 {
		t.Errorf("relay_delivered %d, relay metrics %v delivered of %v calls, ledger %d live of %d entries: want 3 each",
			*ack2.RelayDelivered, delivered, calledRelay, rep.Live, rep.Entries)
	}
	// The hold recorded every settlement: the ledger says codex got all
	// three, and the in-place cut would keep them.
	if ack2.RelayPosition == nil || *ack2.RelayPosition != 3 || rep.Delivered != 3 || rep.Abandoned != 0 || rep.Pending != 0 {
		t.Errorf("relay_position %v; ledger dispositions: %d delivered, %d abandoned, %d pending; want position 3 and 3 delivered",
			ack2.RelayPosition, rep.Delivered, rep.Abandoned, rep.Pending)
	}
}

// call sends one request to the supervisor and fails the test unless it is
// accepted.
func call(t *testing.T, h *supervisor.Child, op string, seq int64) *supervisor.Response {
	t.Helper()
	r, err := h.Call(context.Background(), supervisor.Request{Op: op, Seq: seq})
	if err != nil {
		t.Fatalf("%s %d: %v", op, seq, err)
	}
	if !r.OK {
		t.Fatalf("%s %d: %s (%s)", op, seq, r.Error, r.Code)
	}
	return r
}

// stopSupervisor ends a supervisor the test left running and checks that
// nothing below it survives.
func stopSupervisor(t *testing.T, h *supervisor.Child, finish func()) {
	var tree []proc.Stat
	select {
	case <-h.Done():
	default:
		tree, _ = proc.Descendants(h.Cmd.Process.Pid)
		// A pause may be in force: continue it (refused when none is),
		// then stop.
		for seq := int64(1); seq <= 2; seq++ {
			_, _ = h.Call(context.Background(), supervisor.Request{Op: supervisor.OpContinue, Seq: seq})
		}
		finish()
		if _, err := h.Stop(context.Background(), 30*time.Second); err != nil {
			t.Errorf("stop the supervisor at cleanup: %v", err)
			h.Kill()
		}
	}
	testwait.Until(t, "every process of the harness's tree is gone", 10*time.Second, func() bool {
		for _, s := range tree {
			if proc.Alive(proc.Identity{PID: s.PID, StartTime: s.StartTime}) {
				return false
			}
		}
		return true
	})
}

// metric reads one unlabelled sample from a Prometheus text endpoint.
func metric(t *testing.T, base, name string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatalf("GET %s/metrics: %v", base, err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == name {
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			return v
		}
	}
	t.Fatalf("%s/metrics has no %s (%v)", base, name, errors.Join(sc.Err()))
	return 0
}
