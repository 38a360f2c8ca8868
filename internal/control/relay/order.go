package relay

// order decides the relay's delivery order: which call may go upstream,
// what becomes of an answer, whose turn it is to be delivered, and where
// the settled position and the deliveries stand. A hold stops new upstream
// calls and deliveries; a raise (a restore's new attempt) sends every call
// not delivered upstream again; answers are delivered in the order of
// their ledger positions, each settled (delivered or abandoned) in turn.
//
// It does no I/O and never waits. A method that finds a call cannot go on
// yet says so; the Relay, which calls it under its mutex, waits for a
// change and asks again. Tests step it directly.
type order struct {
	held bool
	gen  int   // bumped when a restore raises the attempt
	last int64 // last call number handed out
	// pos is the ledger position up to which every recorded response is
	// settled (delivered or abandoned); deliveries go in ledger order, so
	// the next one is the entry at pos+1. deliv counts the deliveries.
	pos, deliv int64
	// baseUnknown: a relaunched relay, whose pos and deliv are set from
	// its first recorded response's ledger position.
	baseUnknown bool
	// delivering counts deliveries under way; a hold waits for zero.
	delivering int
	// upstream counts the calls with the upstream now.
	upstream int
	// waiting counts the calls that wait for their turn, by the ledger
	// position of their answer.
	waiting map[int64]int
}

// newOrder is the order of a relay whose first call is numbered first (a
// relaunched relay's, after the calls already in the ledger; 0 or 1 for a
// fresh one).
func newOrder(first int64) *order {
	o := &order{waiting: map[int64]int{}}
	if first > 0 {
		o.last, o.baseUnknown = first-1, true
	}
	return o
}

// number hands out the next call number.
func (o *order) number() int64 {
	o.last++
	return o.last
}

// hold stops new upstream calls and deliveries; a delivery under way
// finishes (idle says when none is).
func (o *order) hold() { o.held = true }

// release lets calls proceed.
func (o *order) release() { o.held = false }

// raise starts a new attempt: every call with the upstream or waiting for
// its turn is to be issued again (the relay cancels those in flight).
func (o *order) raise() { o.gen++ }

// idle reports that no delivery is under way.
func (o *order) idle() bool { return o.delivering == 0 }

// wantsBase reports that the relay does not know where in the ledger its
// harness resumes (a relaunch) until its first call's answer says.
func (o *order) wantsBase() bool { return o.baseUnknown }

// admission is what admit says of a call about to go upstream.
type admission int

const (
	admitWait  admission = iota // held: wait for the release (or for the client to go)
	admitDrop                   // the client has gone: the call is never sent
	admitIssue                  // send it upstream
)

// admit decides whether a call goes upstream now: not during a hold, and
// never once its client has gone. An issued call counts as with the
// upstream until answered; gen is the attempt generation it goes under.
func (o *order) admit(gone bool) (a admission, gen int) {
	switch {
	case gone:
		return admitDrop, o.gen
	case o.held:
		return admitWait, o.gen
	}
	o.upstream++
	return admitIssue, o.gen
}

// answer is what came back from the upstream for one try of a call.
type answer struct {
	failed   bool  // no answer: the upstream could not be reached or read
	stale    bool  // the gateway refused the call's attempt as stale
	recorded bool  // a 2xx answer: a response the ledger holds (when seq > 0)
	seq      int64 // its ledger position; 0 when the upstream keeps no ledger
	// before is, for a relaunched relay's first recorded answer, the
	// deliveries the ledger holds before seq (-1: not said).
	before int64
}

// verdict is what becomes of an answer.
type verdict int

const (
	verdictReissue   verdict = iota // a restore raised the attempt meanwhile: issue it again
	verdictHoldRetry                // it failed during a hold: issue it again after the release (retryable says when)
	verdictFail                     // it failed: the harness gets the error
	verdictQueue                    // in hand: it waits for its turn (deliver)
)

// answered takes a call's answer from the upstream, the call having gone
// under generation gen. wake says that calls waiting for their turn must
// ask again: none is with the upstream any more, so a gap below them that
// no call read may now be skipped (deliver).
func (o *order) answered(gen int, a answer) (v verdict, wake bool) {
	o.upstream--
	v = o.judge(gen, a)
	return v, o.upstream == 0 && len(o.waiting) > 0
}

func (o *order) judge(gen int, a answer) verdict {
	switch {
	case gen != o.gen:
		return verdictReissue
	case o.held && (a.failed || a.stale):
		// A hold is where a checkpoint happens, and a restore from it
		// breaks the upstream connection (a new machine) or raises the
		// attempt at the gateway before the relay learns it at the
		// continue. Neither is the harness's to see.
		return verdictHoldRetry
	case a.failed:
		return verdictFail
	}
	if o.baseUnknown && a.recorded && a.seq > 0 {
		o.pos, o.baseUnknown = a.seq-1, false
		o.deliv = o.pos
		if a.before >= 0 {
			o.deliv = a.before
		}
	}
	if a.recorded && a.seq > 0 {
		o.waiting[a.seq]++
	}
	return verdictQueue
}

// retryable reports that a call that failed during a hold, under
// generation gen, may be issued again: the hold is over or a restore
// raised the attempt.
func (o *order) retryable(gen int) bool { return !o.held || o.gen != gen }

// turn is what deliver says of a queued answer.
type turn struct {
	verdict turnVerdict
	// settles: the answer is the next entry of the ledger (or the upstream
	// keeps none), so delivering or abandoning it moves the position on.
	// An answer at or below the position repeats one already settled.
	settles bool
	// orphans are the entries below the answer that no call will read
	// (their calls failed), settled as abandoned to let it through.
	orphans []settlement
}

type turnVerdict int

const (
	turnWait    turnVerdict = iota // not its turn yet: a hold, or earlier entries not settled
	turnReissue                    // a restore raised the attempt meanwhile: issue it again
	turnAbandon                    // its client has gone: settle it as abandoned, if it settles
	turnWrite                      // write it to the harness, then report (delivered)
)

// deliver decides whether a queued answer (answered said verdictQueue,
// under gen) is delivered now. Its turn comes when the hold is over and
// every earlier entry is settled; gone says its client has left. On
// turnWrite the delivery is under way until delivered is called.
func (o *order) deliver(gen int, a answer, gone bool) turn {
	var t turn
	if o.gen == gen {
		if o.held {
			return turn{verdict: turnWait}
		}
		if a.recorded && a.seq > o.pos+1 {
			if t.orphans = o.skipOrphans(a.seq); t.orphans == nil {
				return turn{verdict: turnWait}
			}
		}
	}
	if a.recorded && a.seq > 0 {
		if o.waiting[a.seq]--; o.waiting[a.seq] <= 0 {
			delete(o.waiting, a.seq)
		}
	}
	switch {
	case o.gen != gen:
		t.verdict = turnReissue
		return t
	case gone:
		t.verdict = turnAbandon
	default:
		t.verdict = turnWrite
		o.delivering++
	}
	t.settles = a.recorded && (a.seq == 0 || a.seq == o.pos+1)
	return t
}

// skipOrphans handles a gap below seq that no call can fill: the gateway
// recorded answers (entries pos+1 .. seq-1) that no call of this relay
// read, because every try to read them failed and their calls gave up
// with an error. When seq is the lowest position any call waits at and no
// call is with the upstream (which could still come back with one of
// those positions), they are settled as abandoned, by position alone, and
// the position moves past them. It returns them, or nil when the gap
// stays.
func (o *order) skipOrphans(seq int64) []settlement {
	if seq <= o.pos+1 || o.upstream > 0 {
		return nil
	}
	for s := range o.waiting {
		if s < seq {
			return nil
		}
	}
	var out []settlement
	for s := o.pos + 1; s < seq; s++ {
		o.pos++
		out = append(out, settlement{seq: s, disp: dispAbandoned})
	}
	return out
}

// delivered ends the delivery of call n's answer (at seq) that deliver
// started (turnWrite, with settles): ok says the whole response was written
// and flushed to a live connection. When the answer settles, the position
// moves past it and its settlement is returned (moved true; it is for the
// gateway when seq > 0).
func (o *order) delivered(n, seq int64, settles, ok bool) (s settlement, moved bool) {
	o.delivering--
	if !settles {
		return settlement{}, false
	}
	return o.settle(n, seq, ok), true
}

// settle moves the position past call n's answer, the ledger's entry at
// seq (0: no ledger), delivered or abandoned.
func (o *order) settle(n, seq int64, delivered bool) settlement {
	o.pos++
	s := settlement{seq: seq, n: n, disp: dispAbandoned}
	if delivered {
		o.deliv++
		s.disp = dispDelivered
	}
	return s
}
