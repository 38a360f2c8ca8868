package ledger

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
)

// settledLedger appends entries for resps and settles those whose index is in
// abandoned as Abandoned, the others as Delivered.
func settledLedger(t *testing.T, abandoned []int, resps ...json.RawMessage) *Ledger {
	t.Helper()
	l, _ := ledgerWith(t, resps...)
	var ss []Settlement
	for i := range resps {
		d := Delivered
		for _, a := range abandoned {
			if a == i {
				d = Abandoned
			}
		}
		ss = append(ss, Settlement{int64(i + 1), fmt.Sprintf("ep/%d", i+1), d})
	}
	if err := l.Settle(ss...); err != nil {
		t.Fatal(err)
	}
	return l
}

func TestMatchSkipsAbandonedEntries(t *testing.T) {
	r := []json.RawMessage{chat("a"), chat("b"), chat("c"), chat("d"), chat("e")}
	msgs := func(idx ...int) []json.RawMessage {
		var as []json.RawMessage
		for _, i := range idx {
			as = append(as, asMessage(t, r[i]))
		}
		return conv(as...)
	}
	// Abandoned in the middle: the conversation has a, c, d (b never
	// reached the harness).
	l := settledLedger(t, []int{1}, r...)
	m, err := l.Match(msgs(0, 2, 3))
	if err != nil || m.Position != 4 || m.Start != 0 || !m.Boundary {
		t.Fatalf("abandoned in the middle: %+v %v", m, err)
	}
	if got := dispositions(l.Entries()); got != "1:ep/1:delivered 2:ep/2:abandoned 3:ep/3:delivered 4:ep/4:delivered" {
		t.Fatalf("after the match: %s", got)
	}
	if e := mustAppend(t, l, entry("ep/5", chat("e2"))); e.Seq != 5 || !e.Boundary {
		t.Fatalf("next entry: %+v", e)
	}
	// The abandoned response in the conversation does not match.
	l = settledLedger(t, []int{1}, r...)
	if _, err := l.Match(msgs(0, 1, 2)); !errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), "not abandoned (1 more were)") {
		t.Fatalf("an abandoned response in the conversation: %v", err)
	}
	// Abandoned at the end: they are cut with the rest after the last
	// matched entry.
	l = settledLedger(t, []int{3, 4}, r...)
	if m, err := l.Match(msgs(0, 1, 2)); err != nil || m.Position != 3 || l.Len() != 3 {
		t.Fatalf("abandoned at the end: %+v %v len %d", m, err, l.Len())
	}
	// Abandoned at the end of a prefix: cut at the last matched entry.
	l = settledLedger(t, []int{2}, r...)
	if m, err := l.Match(msgs(0, 1)); err != nil || m.Position != 2 || l.Len() != 2 {
		t.Fatalf("abandoned after the prefix: %+v %v len %d", m, err, l.Len())
	}
	// Everything abandoned, no assistant message: a start-over, not fresh.
	l = settledLedger(t, []int{0, 1}, r[:2]...)
	if m, err := l.Match(conv()); err != nil || m.Fresh || !m.Boundary || m.Position != 0 || l.Len() != 0 {
		t.Fatalf("all abandoned: %+v %v len %d", m, err, l.Len())
	}
	// Abandoned at the start.
	l = settledLedger(t, []int{0}, r...)
	if m, err := l.Match(msgs(1, 2)); err != nil || m.Position != 3 || m.Start != 0 {
		t.Fatalf("abandoned at the start: %+v %v", m, err)
	}
	h, _ := Read(filepath.Dir(l.Path()), "ep")
	if ev := h.Events[len(h.Events)-1]; !strings.Contains(ev.Reason, "entries 1..3 (the 1 abandoned among them left out)") {
		t.Fatalf("cut reason: %q", ev.Reason)
	}
	// Compacted, an abandoned entry inside the run: c, e after a summary.
	l = settledLedger(t, []int{3}, r...)
	ms := []json.RawMessage{msg("system", "s"), msg("user", "summary"), asMessage(t, r[2]), msg("user", "ok"), asMessage(t, r[4])}
	if m, err := l.Match(ms); err != nil || m.Position != 5 || m.Start != 2 || l.Len() != 5 {
		t.Fatalf("compacted around an abandoned entry: %+v %v len %d", m, err, l.Len())
	}
	// Compacted, the run ends before abandoned entries: they are cut.
	l = settledLedger(t, []int{3, 4}, r...)
	ms = []json.RawMessage{msg("system", "s"), msg("user", "summary"), asMessage(t, r[1]), msg("user", "ok"), asMessage(t, r[2])}
	if m, err := l.Match(ms); err != nil || m.Position != 3 || m.Start != 1 || l.Len() != 3 {
		t.Fatalf("compacted before abandoned entries: %+v %v len %d", m, err, l.Len())
	}
	// A pending entry (not settled yet) counts as seen.
	l, _ = ledgerWith(t, r[:3]...)
	if err := l.Settle(Settlement{2, "ep/2", Abandoned}); err != nil {
		t.Fatal(err)
	}
	if m, err := l.Match(msgs(0, 2)); err != nil || m.Position != 3 {
		t.Fatalf("pending entries: %+v %v", m, err)
	}
}

func TestMatchPartialCopySkipsAbandoned(t *testing.T) {
	withCall := json.RawMessage(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Let me look.","tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls\"}"}}]},"finish_reason":"tool_calls"}]}`)
	partial := json.RawMessage(`{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{}"}}]}`)
	// a, b (abandoned), the tool call: the harness has a and a partial
	// copy of the tool call; the ledger is cut after a.
	l := settledLedger(t, []int{1}, chat("a"), chat("b"), withCall)
	m, err := l.Match(conv(asMessage(t, chat("a")), partial))
	if err != nil || m.Position != 1 || !m.Boundary || l.Len() != 1 {
		t.Fatalf("partial copy after an abandoned entry: %+v %v len %d", m, err, l.Len())
	}
	// The partial copy's entry abandoned itself: the harness cannot have
	// it, so it is no partial copy of it.
	l = settledLedger(t, []int{1}, chat("a"), withCall)
	if _, err := l.Match(conv(asMessage(t, chat("a")), partial)); !errors.Is(err, ErrBroken) {
		t.Fatalf("partial copy of an abandoned entry: %v", err)
	}
}
