package ledger

import (
	"fmt"
	"time"
)

// Disposition is what became of an entry's response: whether the harness
// got it.
type Disposition string

const (
	// Delivered: the relay wrote the whole response to a live connection
	// and flushed it.
	Delivered Disposition = "delivered"
	// Abandoned: the client had gone (timed out, disconnected) and never
	// saw the response.
	Abandoned Disposition = "abandoned"
	// Undelivered: dropped by a cut without having been settled.
	Undelivered Disposition = "undelivered"
	// Pending: recorded, not settled yet (new-format ledgers).
	Pending Disposition = "pending"
)

// Settlement is the disposition of one live entry, named by its seq and
// its call id.
type Settlement struct {
	Seq         int64       `json:"seq"`
	CallID      string      `json:"call_id"`
	Disposition Disposition `json:"disposition"` // Delivered or Abandoned only
}

// check validates a settlement on its own (not against a ledger).
func (s Settlement) check() error {
	if s.Seq < 1 {
		return fmt.Errorf("seq %d (call %q): an entry's seq is at least 1", s.Seq, s.CallID)
	}
	if s.CallID == "" {
		return fmt.Errorf("seq %d: empty call id: a settlement names its entry by seq and call id", s.Seq)
	}
	if s.Disposition != Delivered && s.Disposition != Abandoned {
		return fmt.Errorf("seq %d (call %s): disposition %q: settle an entry %q or %q", s.Seq, s.CallID, s.Disposition, Delivered, Abandoned)
	}
	return nil
}

// Settle records the dispositions of live entries in one write and one
// flush (group commit, as Append). Each settlement must name a live entry
// by seq and call id, with Delivered or Abandoned. Settling an entry again
// with the same disposition is a no-op (nothing is written for it); with
// another disposition it is an error. Any bad settlement fails the whole
// call and nothing is written.
//
// On a format-1 ledger (written before dispositions were recorded) an
// entry not settled reads as Delivered; it may still be settled once,
// either way.
func (l *Ledger) Settle(s ...Settlement) error {
	if len(s) == 0 {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.usable(); err != nil {
		return err
	}
	recs, err := l.settleRecords(s)
	if err != nil || len(recs) == 0 {
		return err
	}
	_, err = l.write(recs...)
	return err
}

// settleRecords checks settlements against the ledger and returns the
// settle record that writes those that change it (none when every one
// repeats a disposition recorded), or why they do not hold. l.mu is held.
func (l *Ledger) settleRecords(s []Settlement) ([]record, error) {
	for _, x := range s {
		if err := x.check(); err != nil {
			return nil, fmt.Errorf("ledger %s: settle: %w; nothing was settled", l.where, err)
		}
	}
	fresh, err := l.st.checkSettle(s)
	if err != nil {
		return nil, fmt.Errorf("ledger %s: settle: %w; nothing was settled", l.where, err)
	}
	if len(fresh) == 0 {
		return nil, nil
	}
	return []record{{Kind: kindSettle, Settled: fresh, At: time.Now().UTC()}}, nil
}

// DeliveredBefore counts the live entries before seq that are not
// Abandoned: what a relaunched relay counts as delivered when its first
// call lands at seq.
func (l *Ledger) DeliveredBefore(seq int64) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := min(max(seq-1, 0), int64(len(l.st.entries)))
	var c int64
	for _, e := range l.st.entries[:n] {
		if e.Disposition != Abandoned {
			c++
		}
	}
	return c
}

// unsettled is the disposition of an entry no settle record names: Pending
// in a ledger that records dispositions, Delivered in a format-1 one (the
// meaning an entry had then).
func (s *state) unsettled() Disposition {
	if s.format == formatV1 {
		return Delivered
	}
	return Pending
}

// checkSettle checks settlements (each valid on its own) against the
// logical ledger and returns those that change it: in order, each entry
// once, without those that repeat a disposition already recorded. It
// changes nothing.
func (s *state) checkSettle(ss []Settlement) ([]Settlement, error) {
	n := int64(len(s.entries))
	var fresh []Settlement
	seen := map[int64]Disposition{}
	for _, x := range ss {
		if x.Seq > n {
			return nil, fmt.Errorf("seq %d (call %s) is not a live entry: the logical ledger has %d entries", x.Seq, x.CallID, n)
		}
		i := x.Seq - 1
		e := s.entries[i]
		if e.CallID != x.CallID {
			return nil, fmt.Errorf("seq %d is call %s, not %s: a settlement names its entry by both", x.Seq, e.CallID, x.CallID)
		}
		if d, ok := seen[x.Seq]; ok {
			if d != x.Disposition {
				return nil, fmt.Errorf("seq %d (call %s) is settled both %s and %s", x.Seq, x.CallID, d, x.Disposition)
			}
			continue
		}
		seen[x.Seq] = x.Disposition
		if s.settled[i] {
			if e.Disposition != x.Disposition {
				return nil, fmt.Errorf("seq %d (call %s) was settled %s; it cannot become %s", x.Seq, x.CallID, e.Disposition, x.Disposition)
			}
			continue
		}
		fresh = append(fresh, x)
	}
	return fresh, nil
}
