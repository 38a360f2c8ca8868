package supervisor_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"stasis/internal/control/relay"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/storage/ledger"
)

// TestHoldPauseGatesTheHostedRelay runs a real supervisor hosting the relay,
// a harness that calls it with curl, and the gateway and a model in this
// process. A hold pause reports relay_delivered equal to what the harness
// received and the ledger holds; nothing is delivered while held; after the
// continue every call is in the ledger once and the chain verifies.
func TestHoldPauseGatesTheHostedRelay(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	model := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c%d","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"answer %d"},"finish_reason":"stop"}]}`, n, n)
	}))
	defer model.Close()
	state := t.TempDir()
	g, err := relay.OpenGateway(relay.GatewayConfig{Upstream: model.URL, State: state})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	gw := httptest.NewServer(g.Handler())
	defer gw.Close()
	ep, err := g.AddEpisode("ep-relay")
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	tok := filepath.Join(work, "token.json")
	b, _ := json.Marshal(ep.Credentials(0))
	if err := os.WriteFile(tok, b, 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(work, "relay.sock")
	out := filepath.Join(work, "answers")
	// The harness: 40 calls, one after another, each answer appended.
	script := `for i in $(seq 1 40); do
		curl -sS --unix-socket "$1" -H 'Content-Type: application/json' \
			-d '{"model":"m","messages":[{"role":"user","content":"call '$i'"}]}' \
			http://relay/v1/chat/completions >> "$2" || exit 1
		echo >> "$2"
	done`
	h := start(t, []string{"--mode", "hold", "--relay-listen", "unix:" + sock, "--relay-upstream", gw.URL, "--relay-token-file", tok},
		script, sock, out)
	eventually(t, "some calls are answered", 15*time.Second, func() bool { return calls.Load() >= 5 })
	a := h.ok(supervisor.OpPause, 1).Ack
	if a.RelayDelivered == nil {
		t.Fatalf("hold ack without relay_delivered: %+v", a)
	}
	delivered := *a.RelayDelivered
	lines := func() int64 {
		b, _ := os.ReadFile(out)
		return int64(strings.Count(string(b), "\n"))
	}
	// While held: the harness's count stays at the deliveries.
	eventually(t, "the delivery under way is written", 5*time.Second, func() bool { return lines() == delivered })
	time.Sleep(200 * time.Millisecond) // observation window: nothing is delivered during a hold
	if got := lines(); got != delivered {
		t.Fatalf("the harness received %d answers during a hold that reported %d delivered", got, delivered)
	}
	h.ok(supervisor.OpContinue, 1)
	if err := h.c.Wait(60 * time.Second); err != nil {
		t.Fatalf("harness did not finish: %v", err)
	}
	if got := lines(); got != 40 {
		t.Fatalf("the harness got %d answers for 40 calls", got)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	rep, err := ledger.VerifyIn(g.Ledgers(), "ep-relay")
	if err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
	l, err := ledger.OpenIn(g.Ledgers(), "ep-relay")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	es := l.Entries()
	if len(es) != 40 || calls.Load() != 40 {
		t.Fatalf("ledger %d entries, model %d calls, for 40 calls", len(es), calls.Load())
	}
	seen := map[string]bool{}
	for _, e := range es {
		if seen[e.CallID] {
			t.Fatalf("call %s twice in the ledger", e.CallID)
		}
		seen[e.CallID] = true
	}
}
