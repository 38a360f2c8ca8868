package clients

import (
	"encoding/json"
	"path/filepath"
	"testing"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/control/relay"
	"stasis/internal/storage/ledger"
	"stasis/internal/testwait"
)

// slowRun is what slowstream.mjs prints.
type slowRun struct {
	Text   string  `json:"text"`
	Chunks int     `json:"chunks"`
	Error  *string `json:"error"`
	MS     int64   `json:"ms"`
}

// TestSDKStreamOutlivesItsTimeout: the SDK's request timeout (1 s) is
// shorter than the generation (about 2 s) and than a hold the relay keeps
// while the call is in flight. Directly the model's first chunk beats the
// timeout; through the relay, which stores the whole response first, the
// status and SSE headers at once and heartbeats meanwhile do, and the
// client gets the same text.
func TestSDKStreamOutlivesItsTimeout(t *testing.T) {
	node, sdk := requireNode(t), requireSDK(t)
	script, err := filepath.Abs(filepath.Join("testdata", "slowstream.mjs"))
	if err != nil {
		t.Fatal(err)
	}
	// About 60 tokens of answer at 35 ms each.
	s := startStack(t, model.Options{TokenDelay: 35 * time.Millisecond}, "ep-slow", func(c *relay.Config) { c.Heartbeat = 200 * time.Millisecond })
	run := func(base string) slowRun {
		out, err := runNode(node, 60*time.Second, script, sdk, base+"/v1", "1000")
		if err != nil {
			t.Fatal(err)
		}
		var r slowRun
		if err := json.Unmarshal(out, &r); err != nil {
			t.Fatalf("slowstream.mjs printed %s: %v", out, err)
		}
		return r
	}
	direct := run(s.Model.URL)
	if direct.Error != nil || direct.Text == "" || direct.MS < 1000 {
		t.Fatalf("directly: %+v; want the whole text, in more than the 1 s timeout", direct)
	}
	got := make(chan slowRun, 1)
	go func() { got <- run(s.Relay.URL) }()
	// Hold the relay while the call is with the model, for longer than the
	// client's timeout after the generation.
	testwait.Until(t, "the call reaches the model", 20*time.Second, func() bool { return s.upstream.n.Load() == 1 })
	held, err := s.R.Hold()
	if err != nil {
		t.Fatal(err)
	}
	if held.Delivered != 0 {
		t.Fatalf("hold: %+v", held)
	}
	testwait.Until(t, "the response is recorded during the hold", 20*time.Second, func() bool {
		h, err := ledger.ReadIn(s.Gateway.Ledgers(), s.Episode)
		return err == nil && len(h.Entries) == 1
	})
	heldAt := time.Now()
	testwait.Until(t, "the hold outlasts the client's timeout", 10*time.Second, func() bool { return time.Since(heldAt) > 1500*time.Millisecond })
	if err := s.R.Release(); err != nil {
		t.Fatal(err)
	}
	relayed := <-got
	if relayed.Error != nil || relayed.Text != direct.Text {
		t.Fatalf("through the relay: %+v\ndirectly: %+v", relayed, direct)
	}
	testwait.Until(t, "the delivery is counted", 10*time.Second, func() bool { return s.R.Delivered() == 1 })
}
