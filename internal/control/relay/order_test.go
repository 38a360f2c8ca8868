package relay

import (
	"fmt"
	"maps"
	"slices"
	"testing"
)

// state describes an order in one line, for the tables below.
func (o *order) state() string {
	s := fmt.Sprintf("pos=%d deliv=%d upstream=%d delivering=%d", o.pos, o.deliv, o.upstream, o.delivering)
	if o.held {
		s += " held"
	}
	if o.baseUnknown {
		s += " base?"
	}
	for _, seq := range slices.Sorted(maps.Keys(o.waiting)) {
		s += fmt.Sprintf(" waiting@%d×%d", seq, o.waiting[seq])
	}
	return s
}

// at makes an order in a given state: settled up to pos (all delivered),
// with the calls upstream and the answers waiting given.
func at(pos int64, upstream int, waiting ...int64) *order {
	o := newOrder(0)
	o.pos, o.deliv, o.upstream = pos, pos, upstream
	for _, s := range waiting {
		o.waiting[s]++
	}
	return o
}

func (o *order) holding() *order { o.hold(); return o }
func (o *order) raised() *order  { o.raise(); return o }
func (o *order) relaunched() *order {
	o.baseUnknown = true
	return o
}

func recordedAt(seq int64) answer { return answer{recorded: true, seq: seq, before: -1} }

func TestOrderAdmit(t *testing.T) {
	for _, c := range []struct {
		name  string
		o     *order
		gone  bool
		want  admission
		after string
	}{
		{"running: the call goes upstream", at(0, 0), false, admitIssue, "pos=0 deliv=0 upstream=1 delivering=0"},
		{"held: the call waits", at(0, 0).holding(), false, admitWait, "pos=0 deliv=0 upstream=0 delivering=0 held"},
		{"the client has gone: never sent", at(0, 0), true, admitDrop, "pos=0 deliv=0 upstream=0 delivering=0"},
		{"the client went during the hold: never sent", at(0, 0).holding(), true, admitDrop, "pos=0 deliv=0 upstream=0 delivering=0 held"},
	} {
		t.Run(c.name, func(t *testing.T) {
			gen := c.o.gen
			got, g := c.o.admit(c.gone)
			if got != c.want || g != gen || c.o.state() != c.after {
				t.Fatalf("admit: %v gen %d, state %q; want %v gen %d, %q", got, g, c.o.state(), c.want, gen, c.after)
			}
		})
	}
}

func TestOrderAnswered(t *testing.T) {
	stale := answer{stale: true, before: -1}
	for _, c := range []struct {
		name  string
		o     *order
		a     answer
		want  verdict
		wake  bool // the waiting calls must ask again
		after string
	}{
		{"recorded: waits for its turn", at(1, 1), recordedAt(2), verdictQueue, true, "pos=1 deliv=1 upstream=0 delivering=0 waiting@2×1"},
		{"no ledger upstream: waits, at no position", at(1, 1), recordedAt(0), verdictQueue, false, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"an error answer: goes to the harness, at no position", at(1, 1), answer{before: -1}, verdictQueue, false, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"stale while running: the harness gets the refusal", at(1, 1), stale, verdictQueue, false, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"failed: the harness gets the error", at(1, 1), answer{failed: true}, verdictFail, false, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"failed, a call waiting behind its entry: it asks again", at(1, 1, 3), answer{failed: true}, verdictFail, true, "pos=1 deliv=1 upstream=0 delivering=0 waiting@3×1"},
		{"failed, another call still upstream: no gap closes yet", at(1, 2, 3), answer{failed: true}, verdictFail, false, "pos=1 deliv=1 upstream=1 delivering=0 waiting@3×1"},
		{"recorded, another call still upstream", at(1, 2), recordedAt(2), verdictQueue, false, "pos=1 deliv=1 upstream=1 delivering=0 waiting@2×1"},
		{"failed during a hold: waits for the continue", at(1, 1).holding(), answer{failed: true}, verdictHoldRetry, false, "pos=1 deliv=1 upstream=0 delivering=0 held"},
		{"stale during a hold: waits for the continue", at(1, 1).holding(), stale, verdictHoldRetry, false, "pos=1 deliv=1 upstream=0 delivering=0 held"},
		{"recorded during a hold: waits for its turn", at(1, 1).holding(), recordedAt(2), verdictQueue, true, "pos=1 deliv=1 upstream=0 delivering=0 held waiting@2×1"},
		{"raised meanwhile: issued again", at(1, 1).raised(), recordedAt(2), verdictReissue, false, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"raised meanwhile, failed: issued again", at(1, 1).raised(), answer{failed: true}, verdictReissue, false, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"relaunched: the first recorded answer sets the base", at(0, 1).relaunched(), answer{recorded: true, seq: 5, before: 3}, verdictQueue, true, "pos=4 deliv=3 upstream=0 delivering=0 waiting@5×1"},
		{"relaunched, the ledger not saying its deliveries", at(0, 1).relaunched(), recordedAt(5), verdictQueue, true, "pos=4 deliv=4 upstream=0 delivering=0 waiting@5×1"},
		{"relaunched: an error answer leaves the base unknown", at(0, 1).relaunched(), answer{before: -1}, verdictQueue, false, "pos=0 deliv=0 upstream=0 delivering=0 base?"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got, wake := c.o.answered(0, c.a); got != c.want || wake != c.wake || c.o.state() != c.after {
				t.Fatalf("answered: %v wake %v, state %q; want %v %v, %q", got, wake, c.o.state(), c.want, c.wake, c.after)
			}
		})
	}
}

func TestOrderDeliver(t *testing.T) {
	for _, c := range []struct {
		name    string
		o       *order // the answer is already queued (waiting) in it
		a       answer
		gone    bool
		want    turnVerdict
		settles bool
		orphans []int64
		after   string
	}{
		{"next in the ledger: written", at(1, 0, 2), recordedAt(2), false, turnWrite, true, nil, "pos=1 deliv=1 upstream=0 delivering=1"},
		{"held: waits", at(1, 0, 2).holding(), recordedAt(2), false, turnWait, false, nil, "pos=1 deliv=1 upstream=0 delivering=0 held waiting@2×1"},
		{"an earlier entry waits to be settled", at(1, 0, 2, 3), recordedAt(3), false, turnWait, false, nil, "pos=1 deliv=1 upstream=0 delivering=0 waiting@2×1 waiting@3×1"},
		{"a gap while a call is upstream: waits", at(1, 1, 3), recordedAt(3), false, turnWait, false, nil, "pos=1 deliv=1 upstream=1 delivering=0 waiting@3×1"},
		{"a gap no call can fill: settled abandoned, then written", at(1, 0, 4), recordedAt(4), false, turnWrite, true, []int64{2, 3}, "pos=3 deliv=1 upstream=0 delivering=1"},
		{"a gap, but held: waits", at(1, 0, 4).holding(), recordedAt(4), false, turnWait, false, nil, "pos=1 deliv=1 upstream=0 delivering=0 held waiting@4×1"},
		{"the client has gone: abandoned", at(1, 0, 2), recordedAt(2), true, turnAbandon, true, nil, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"the client has gone, a repeat: nothing to settle", at(2, 0, 2), recordedAt(2), true, turnAbandon, false, nil, "pos=2 deliv=2 upstream=0 delivering=0"},
		{"a repeat of a settled entry: written, settles nothing", at(2, 0, 2), recordedAt(2), false, turnWrite, false, nil, "pos=2 deliv=2 upstream=0 delivering=1"},
		{"an error answer: written, settles nothing", at(1, 0), answer{before: -1}, false, turnWrite, false, nil, "pos=1 deliv=1 upstream=0 delivering=1"},
		{"no ledger upstream: written, settles", at(1, 0), recordedAt(0), false, turnWrite, true, nil, "pos=1 deliv=1 upstream=0 delivering=1"},
		{"raised meanwhile: issued again", at(1, 0, 2).raised(), recordedAt(2), false, turnReissue, false, nil, "pos=1 deliv=1 upstream=0 delivering=0"},
		{"raised during the hold: issued again", at(1, 0, 2).holding().raised(), recordedAt(2), false, turnReissue, false, nil, "pos=1 deliv=1 upstream=0 delivering=0 held"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := c.o.deliver(0, c.a, c.gone)
			var orphans []int64
			for _, s := range got.orphans {
				if s.n != 0 || s.disp != dispAbandoned {
					t.Fatalf("orphan %+v: want abandoned, of no call", s)
				}
				orphans = append(orphans, s.seq)
			}
			if got.verdict != c.want || got.settles != c.settles || !slices.Equal(orphans, c.orphans) || c.o.state() != c.after {
				t.Fatalf("deliver: %v settles %v orphans %v, state %q; want %v %v %v, %q", got.verdict, got.settles, orphans, c.o.state(), c.want, c.settles, c.orphans, c.after)
			}
		})
	}
}

func TestOrderDelivered(t *testing.T) {
	for _, c := range []struct {
		name    string
		settles bool
		ok      bool
		moved   bool
		want    settlement
		after   string
	}{
		{"written whole: delivered", true, true, true, settlement{seq: 3, n: 7, disp: dispDelivered}, "pos=3 deliv=3 upstream=0 delivering=0"},
		{"the write failed: abandoned", true, false, true, settlement{seq: 3, n: 7, disp: dispAbandoned}, "pos=3 deliv=2 upstream=0 delivering=0"},
		{"settles nothing", false, true, false, settlement{}, "pos=2 deliv=2 upstream=0 delivering=0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			o := at(2, 0)
			o.delivering = 1
			s, moved := o.delivered(7, 3, c.settles, c.ok)
			if s != c.want || moved != c.moved || o.state() != c.after || !o.idle() {
				t.Fatalf("delivered: %+v %v, state %q; want %+v %v, %q", s, moved, o.state(), c.want, c.moved, c.after)
			}
		})
	}
}

// TestOrderSteps steps an order through a hold, answers out of ledger
// order, a raise and a gap, as the relay's calls would.
func TestOrderSteps(t *testing.T) {
	o := newOrder(0)
	expect := func(what string, got, want any) {
		t.Helper()
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s: %v, want %v (state %s)", what, got, want, o.state())
		}
	}
	one, two := o.number(), o.number()
	expect("call numbers", []int64{one, two}, []int64{1, 2})
	_, gen := o.admit(false)
	o.admit(false)
	o.hold()
	expect("a new call during the hold", first(o.admit(false)), admitWait)

	// Both answers come back during the hold, call 2's first (entry 1),
	// call 1's then (entry 2).
	expect("call 2's answer", first(o.answered(gen, recordedAt(1))), verdictQueue)
	expect("call 2's turn during the hold", o.deliver(gen, recordedAt(1), false).verdict, turnWait)
	expect("call 1's answer", first(o.answered(gen, recordedAt(2))), verdictQueue)
	expect("call 1's turn during the hold", o.deliver(gen, recordedAt(2), false).verdict, turnWait)
	expect("idle during the hold", o.idle(), true)

	o.release()
	expect("call 1 behind entry 1", o.deliver(gen, recordedAt(2), false).verdict, turnWait)
	t2 := o.deliver(gen, recordedAt(1), false)
	expect("call 2's turn", []any{t2.verdict, t2.settles}, []any{turnWrite, true})
	o.hold() // a pause while call 2 is written: not idle until it is
	expect("idle while writing", o.idle(), false)
	s, _ := o.delivered(2, 1, t2.settles, true)
	expect("call 2 delivered", s, settlement{seq: 1, n: 2, disp: dispDelivered})
	expect("idle once written", o.idle(), true)
	expect("call 1 during the new hold", o.deliver(gen, recordedAt(2), false).verdict, turnWait)

	// A restore from that pause: call 1 is issued again under the new
	// attempt and lands at entry 2 again (the ledger was cut to 1).
	o.raise()
	o.release()
	expect("call 1 after the raise", o.deliver(gen, recordedAt(2), false).verdict, turnReissue)
	_, gen2 := o.admit(false)
	expect("the new generation", gen2, gen+1)
	expect("call 1's new answer", first(o.answered(gen2, recordedAt(2))), verdictQueue)
	t1 := o.deliver(gen2, recordedAt(2), false)
	expect("call 1's turn", t1.verdict, turnWrite)
	o.delivered(1, 2, t1.settles, true)
	expect("after both", o.state(), "pos=2 deliv=2 upstream=0 delivering=0")

	// Call 3 fails after the gateway recorded entry 3; call 4's answer at
	// entry 4 waits while call 5 is upstream, and goes once call 5 is
	// back with entry 5.
	_, g := o.admit(false)
	o.admit(false)
	o.admit(false)
	expect("call 3 fails", first(o.answered(g, answer{failed: true})), verdictFail)
	expect("call 4's answer", first(o.answered(g, recordedAt(4))), verdictQueue)
	expect("call 4 while call 5 is upstream", o.deliver(g, recordedAt(4), false).verdict, turnWait)
	v, wake := o.answered(g, recordedAt(5))
	expect("call 5's answer, the last upstream: the waiting calls ask again", []any{v, wake}, []any{verdictQueue, true})
	expect("call 5 behind call 4", o.deliver(g, recordedAt(5), false).verdict, turnWait)
	t4 := o.deliver(g, recordedAt(4), false)
	expect("call 4 once none is upstream", []any{t4.verdict, len(t4.orphans), t4.orphans[0].seq}, []any{turnWrite, 1, 3})
	o.delivered(4, 4, t4.settles, true)
	t5 := o.deliver(g, recordedAt(5), false)
	o.delivered(5, 5, t5.settles, false)
	expect("in the end", o.state(), "pos=5 deliv=3 upstream=0 delivering=0")
}

func first[A, B any](a A, _ B) A { return a }

func TestOrderOfARelaunchedRelay(t *testing.T) {
	o := newOrder(7)
	if n := o.number(); n != 7 || !o.wantsBase() {
		t.Fatalf("first call %d, base unknown %v; want 7, true", n, o.wantsBase())
	}
	if o := newOrder(0); o.number() != 1 || o.wantsBase() {
		t.Fatal("a fresh relay numbers from 1 and knows its base")
	}
	_, gen := o.admit(false)
	o.answered(gen, answer{recorded: true, seq: 12, before: 9})
	if o.wantsBase() || o.pos != 11 || o.deliv != 9 {
		t.Fatalf("after the first answer: %s", o.state())
	}
}
