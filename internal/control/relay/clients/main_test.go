package clients

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/control/relay"
	"stasis/internal/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// sdkVersion is the openai npm SDK `make deps-clients` pins (the Makefile's
// OPENAI_SDK_VERSION).
const sdkVersion = "6.49.0"

// npmPrefix is where `make deps-clients` installs the clients, under the
// module root.
const npmPrefix = ".tools/npm"

// moduleRoot is the nearest directory above the working directory holding
// go.mod.
func moduleRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		up := filepath.Dir(dir)
		if up == dir {
			t.Fatal("no go.mod above the working directory")
		}
		dir = up
	}
}

// requireNode returns the node binary, failing the test (not skipping it)
// when there is none.
func requireNode(t testing.TB) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatalf("node (Node.js 20) is not on $PATH: %v; `make deps-clients` installs nodejs and npm with the clients", err)
	}
	return node
}

// requireSDK returns the openai npm SDK's package directory, failing the
// test when it is missing or at another version than the pinned one.
func requireSDK(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(moduleRoot(t), npmPrefix, "node_modules", "openai")
	b, err := os.ReadFile(filepath.Join(dir, "package.json"))
	if err != nil {
		t.Fatalf("the openai npm SDK is not installed: %v; run `make deps-clients`", err)
	}
	var pkg struct {
		Version string `json:"version"`
	}
	if err := json.Unmarshal(b, &pkg); err != nil || pkg.Version != sdkVersion {
		t.Fatalf("%s: openai version %q (%v), want %s; run `make deps-clients`", dir, pkg.Version, err, sdkVersion)
	}
	return dir
}

// runNode runs a node script to its end (or kills it at the deadline) and
// returns its stdout; an error carries its stderr. It does not fail the
// test itself, so it may run on any goroutine.
func runNode(node string, timeout time.Duration, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, args...)
	cmd.WaitDelay = 5 * time.Second
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("node %v: %v\nstderr:\n%s\nstdout:\n%s", args, err, errb.Bytes(), out.Bytes())
	}
	return out.Bytes(), nil
}

// counter counts the requests an http.Handler serves.
type counter struct {
	h http.Handler
	n atomic.Int64
}

func (c *counter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodPost {
		c.n.Add(1)
	}
	c.h.ServeHTTP(w, r)
}

// stack is a scripted model served alone and a second one behind a
// gateway and a relay, one episode's.
type stack struct {
	Model    *httptest.Server // the scripted model, called directly
	Relay    *httptest.Server // relay → gateway → its own scripted model
	Gateway  *relay.Gateway
	R        *relay.Relay // the relay, to hold and release
	Episode  string
	direct   *counter // POSTs the directly called model served
	upstream *counter // POSTs the model behind the gateway served
}

// startStack starts the servers; they are closed when the test ends.
func startStack(t testing.TB, opts model.Options, episode string, tweak ...func(*relay.Config)) *stack {
	t.Helper()
	s := &stack{Episode: episode, direct: &counter{h: model.New(opts)}, upstream: &counter{h: model.New(opts)}}
	s.Model = httptest.NewServer(s.direct)
	t.Cleanup(s.Model.Close)
	up := httptest.NewServer(s.upstream)
	t.Cleanup(up.Close)
	g, err := relay.OpenGateway(relay.GatewayConfig{Upstream: up.URL, State: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.Close(); err != nil {
			t.Errorf("close the gateway: %v", err)
		}
	})
	s.Gateway = g
	gw := httptest.NewServer(g.Handler())
	t.Cleanup(gw.Close)
	ep, err := g.AddEpisode(episode)
	if err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(t.TempDir(), "token.json")
	b, err := json.Marshal(ep.Credentials(0))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tok, b, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := relay.Config{Upstream: gw.URL, TokenFile: tok}
	for _, f := range tweak {
		f(&cfg)
	}
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.R = r
	s.Relay = httptest.NewServer(r.Handler())
	t.Cleanup(s.Relay.Close)
	return s
}

// describe is a value's JSON, for messages.
func describe(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%v", v)
	}
	return string(b)
}
