package opencode_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/control/serve"
	"stasis/internal/control/system"
	"stasis/internal/insandbox/harness/opencode"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// runBudget bounds one OpenCode run; the supervisor's deadline is the same.
const runBudget = 2 * time.Minute

func TestConfig(t *testing.T) {
	b, err := opencode.Config("http://127.0.0.1:4000/v1", "m1")
	if err != nil {
		t.Fatal(err)
	}
	var c struct {
		Model            string   `json:"model"`
		EnabledProviders []string `json:"enabled_providers"`
		Share            string   `json:"share"`
		Autoupdate       *bool    `json:"autoupdate"`
		Provider         map[string]struct {
			NPM     string                     `json:"npm"`
			Options map[string]string          `json:"options"`
			Models  map[string]json.RawMessage `json:"models"`
		} `json:"provider"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatal(err)
	}
	p, ok := c.Provider[opencode.Provider]
	if c.Model != "stasis/m1" || len(c.Provider) != 1 || !ok || p.NPM != "@ai-sdk/openai-compatible" ||
		p.Options["baseURL"] != "http://127.0.0.1:4000/v1" || p.Models["m1"] == nil ||
		len(c.EnabledProviders) != 1 || c.EnabledProviders[0] != opencode.Provider ||
		c.Share != "disabled" || c.Autoupdate == nil || *c.Autoupdate {
		t.Fatalf("config:\n%s", b)
	}
	for _, bad := range [][2]string{{"unix:///tmp/relay.sock", "m"}, {"127.0.0.1:4000", "m"}, {"http://127.0.0.1:1/v1", ""}, {"http://127.0.0.1:1/v1", "a/b"}} {
		if _, err := opencode.Config(bad[0], bad[1]); err == nil {
			t.Errorf("Config(%q, %q) accepted", bad[0], bad[1])
		}
	}
}

func TestBinaryOverride(t *testing.T) {
	t.Setenv(opencode.EnvBinary, filepath.Join(t.TempDir(), "missing"))
	if _, err := opencode.Binary(); err == nil || !strings.Contains(err.Error(), opencode.EnvBinary) {
		t.Fatalf("a missing $%s: %v", opencode.EnvBinary, err)
	}
}

// The episode tests run one after another: each checks that the test process
// is left with no child, which a parallel one would break.

// TestOpenCodeThroughRelay: a real OpenCode holds a conversation with the
// scripted model through a supervisor-hosted relay and the gateway; every
// call is in the ledger once and the tools really ran.
func TestOpenCodeThroughRelay(t *testing.T) {
	runEpisode(t, false)
}

// TestOpenCodePauseContinue: the same with a stop-mode pause once the first
// call is in the ledger, taken while the second is at the model; the pause
// reports one delivery, and the run completes after the continue.
func TestOpenCodePauseContinue(t *testing.T) {
	runEpisode(t, true)
}

// countingModel serves the scripted model and counts the calls it answered
// with success. With gate set, the second call closes second and waits for
// the gate to open.
type countingModel struct {
	h      http.Handler
	ok     atomic.Int64
	n      atomic.Int64
	gate   chan struct{}
	second chan struct{}
}

func (m *countingModel) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	chat := strings.HasSuffix(r.URL.Path, "/chat/completions")
	if chat && m.n.Add(1) == 2 && m.gate != nil {
		close(m.second)
		select {
		case <-m.gate:
		case <-r.Context().Done():
		case <-time.After(runBudget):
		}
	}
	sw := &serve.StatusRecorder{ResponseWriter: w}
	m.h.ServeHTTP(sw, r)
	if chat && sw.Status()/100 == 2 {
		m.ok.Add(1)
	}
}

// lockedBuffer is an io.Writer safe to read while the supervisor writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func runEpisode(t *testing.T, pause bool) {
	bin, err := opencode.Binary()
	if err != nil {
		t.Fatalf("OpenCode is not installed: %v\n`make deps-opencode` installs it (`make test` does it first)", err)
	}
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), runBudget+30*time.Second)
	defer cancel()

	// The work tree OpenCode acts on, with a file to read and a file whose
	// name only `ls` can reveal.
	base := t.TempDir()
	work := filepath.Join(base, "work")
	if err := os.MkdirAll(work, 0o755); err != nil {
		t.Fatal(err)
	}
	marker := fmt.Sprintf("stasis-readme-marker-%d", time.Now().UnixNano())
	listed := "only-ls-shows-this-file.txt"
	for name, content := range map[string]string{"README.md": "# demo\n" + marker + "\n", listed: "x\n"} {
		if err := os.WriteFile(filepath.Join(work, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	written := filepath.Join(work, "notes.txt")
	const notes = "written by OpenCode for stasis\n"
	const prompt = "Read the README, list the files, and write notes.txt."
	const answer = "Read README.md, listed the work tree and wrote notes.txt. Done."
	script := mustScript(t, map[string]any{"name": "opencode", "turns": []any{
		turn("read", map[string]any{"filePath": filepath.Join(work, "README.md")}),
		turn("bash", map[string]any{"command": "ls", "description": "List the work tree"}),
		turn("write", map[string]any{"filePath": written, "content": notes}),
		map[string]any{"content": answer},
	}})

	// The model in this process; the system's gateway (stasistest.NewWorld)
	// forwards to it.
	m := &countingModel{h: model.New(model.Options{Script: script})}
	openGate := func() {}
	if pause {
		m.gate, m.second = make(chan struct{}), make(chan struct{})
		openGate = sync.OnceFunc(func() { close(m.gate) })
	}
	modelSrv := httptest.NewServer(m)
	defer modelSrv.Close()
	defer openGate() // before the server's Close, which waits for its handlers
	w := stasistest.NewWorld(t, func(c *system.Config) { c.ModelUpstream, c.LivenessInterval = modelSrv.URL, -1 })
	g := w.Gateway
	const episode = "ep-opencode"
	ep, err := g.AddEpisode(episode)
	if err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(base, "token.json")
	cred, _ := json.Marshal(ep.Credentials(0))
	if err := os.WriteFile(tok, cred, 0o600); err != nil {
		t.Fatal(err)
	}

	// OpenCode under a supervisor that hosts the relay on a loopback port.
	relayAddr := stasistest.FreeLoopbackAddr(t)
	ocDir := filepath.Join(base, "opencode")
	if err := opencode.Prepare(bin, ocDir, "http://"+relayAddr+"/v1", model.DefaultName); err != nil {
		t.Fatal(err)
	}
	out := &lockedBuffer{}
	c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
		Exe: stasistest.Exe(), Env: append(append([]string{}, stasistest.Env...), opencode.Env(ocDir)...),
		Dir: filepath.Join(base, "session"),
		Flags: []string{"--mode", "stop", "--stop-confirm-timeout", "60s", "--deadline", runBudget.String(), "--log-level", "warn",
			"--relay-listen", relayAddr, "--relay-upstream", "unix://" + w.GatewaySocket, "--relay-token-file", tok},
		Argv:   opencode.Argv(bin, work, prompt),
		Stdout: out, Stderr: out,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		select {
		case <-c.Done():
		default:
			c.Kill()
		}
		stasistest.NoChildrenLeft(t)
		if t.Failed() {
			t.Logf("OpenCode's output:\n%s", out.String())
			logs, _ := filepath.Glob(filepath.Join(opencode.DataDir(ocDir), "log", "*.log"))
			for _, l := range logs {
				b, _ := os.ReadFile(l)
				t.Logf("%s:\n%s", l, b)
			}
		}
	}()

	if pause {
		// The second call at the model: the first is in the ledger and
		// delivered (OpenCode sent the second after acting on it).
		select {
		case <-m.second:
		case <-c.Done():
			t.Fatalf("the supervisor exited before the second model call")
		case <-ctx.Done():
			t.Fatalf("no second model call within %s", runBudget)
		}
		rep, err := ledger.VerifyIn(g.Ledgers(), episode)
		if err != nil || !rep.OK || rep.Live != 1 {
			t.Fatalf("the ledger at the second call: %+v %v", rep, err)
		}
		r, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpPause, Seq: 1})
		// The second call may now finish upstream and reach the ledger; the
		// relay holds its delivery until the continue.
		openGate()
		if err != nil {
			t.Fatalf("pause 1: %v", err)
		}
		if a := r.Ack; !a.Confirmed || a.RelayDelivered == nil || *a.RelayDelivered != 1 {
			t.Fatalf("pause ack: %+v", a)
		}
		st, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpStatus})
		if err != nil || st.Status.State != "paused" {
			t.Fatalf("status during the pause: %+v %v", st, err)
		}
		if _, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpContinue, Seq: 1}); err != nil {
			t.Fatalf("continue 1: %v", err)
		}
	}

	if err := c.Wait(runBudget + 15*time.Second); err != nil {
		t.Fatalf("supervisor: %v", err)
	}
	rc, err := supervisor.ReadReceipt(c.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if rc.ReturnCode == nil || *rc.ReturnCode != 0 || rc.TimedOut || !rc.CleanupConfirmed {
		t.Fatalf("OpenCode did not exit 0: %+v", rc)
	}
	if !strings.Contains(out.String(), answer) {
		t.Errorf("OpenCode did not print the final answer %q", answer)
	}

	// The tools really ran.
	if b, err := os.ReadFile(written); err != nil || string(b) != notes {
		t.Errorf("OpenCode's write tool: %q %v", b, err)
	}

	// The ledger: every successful model call once, in a chain that
	// verifies, with the host side (the gateway) closed.
	w.Crash()
	rep, err := ledger.VerifyIn(g.Ledgers(), episode)
	if err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
	l, err := ledger.OpenIn(g.Ledgers(), episode)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	es := l.Entries()
	calls := m.ok.Load()
	if calls < 3 || int64(len(es)) != calls || rep.Live != calls {
		t.Fatalf("model answered %d calls; ledger has %d entries (live %d)", calls, len(es), rep.Live)
	}
	seen := map[string]bool{}
	for _, e := range es {
		if seen[e.CallID] {
			t.Fatalf("call %s twice in the ledger", e.CallID)
		}
		seen[e.CallID] = true
	}
	// The prompt opened the conversation, and each tool's output is in the
	// conversation OpenCode sent next.
	wantInMessage(t, es, 0, "user", prompt)
	wantInMessage(t, es, 1, "tool", marker)
	wantInMessage(t, es, 2, "tool", listed)
	t.Logf("OpenCode %s: %d model calls, %d ledger entries, in %s", opencode.Version, calls, len(es), time.Since(began).Round(time.Millisecond))
}

// wantInMessage checks that entry i's request carries s in a message of
// the role.
func wantInMessage(t *testing.T, es []ledger.Entry, i int, role, s string) {
	t.Helper()
	if i >= len(es) {
		t.Fatalf("no ledger entry %d", i+1)
	}
	var req struct {
		Messages []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(es[i].Request, &req); err != nil {
		t.Fatalf("entry %d: %v", i+1, err)
	}
	for _, msg := range req.Messages {
		if msg.Role == role && strings.Contains(string(msg.Content), s) {
			return
		}
	}
	t.Errorf("call %d's conversation has no %s message with %q:\n%.3000s", i+1, role, s, es[i].Request)
}

func turn(tool string, args map[string]any) map[string]any {
	return map[string]any{"tool_calls": []any{map[string]any{"name": tool, "arguments": args}}}
}

func mustScript(t *testing.T, v any) *model.Script {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	s, err := model.ParseScript(b)
	if err != nil {
		t.Fatal(err)
	}
	return s
}
