package relay

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"stasis/internal/storage/ledger"
)

// Headers of the settlement path between relay and gateway.
const (
	// HeaderSettled carries settlements from the relay to the gateway:
	// "SEQ.N.D" items separated by commas, where SEQ is the ledger
	// position, N the call number (the call id is EPISODE/N; 0 for an
	// answer the gateway recorded but no call of the relay read) and D is
	// d (delivered) or a (abandoned).
	HeaderSettled = "X-Stasis-Settled"
	// HeaderSettledOK on the gateway's answer says it recorded the
	// settlements the request carried (or found them recorded already).
	HeaderSettledOK = "X-Stasis-Settled-Ok"
	// HeaderWantBase asks the gateway, on a relaunched relay's call, how
	// many of the ledger's entries before this call's were delivered
	// (HeaderDeliveredBefore on the answer).
	HeaderWantBase        = "X-Stasis-Want-Base"
	HeaderDeliveredBefore = "X-Stasis-Delivered-Before"
)

// settlePath is the gateway's endpoint for settlements that have no call
// to ride on.
const settlePath = "/stasis/v1/settle"

type disposition byte

const (
	dispDelivered disposition = 'd'
	dispAbandoned disposition = 'a'
)

// settlement is the relay's word on one recorded response: the harness got
// it whole, or its client had gone.
type settlement struct {
	seq, n int64
	disp   disposition
}

func formatSettlements(s []settlement) string {
	var b strings.Builder
	for i, x := range s {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(x.seq, 10))
		b.WriteByte('.')
		b.WriteString(strconv.FormatInt(x.n, 10))
		b.WriteByte('.')
		b.WriteByte(byte(x.disp))
	}
	return b.String()
}

// maxSettlements bounds the items one header may carry.
const maxSettlements = 4096

// ParseSettlements reads a HeaderSettled value into ledger settlements of
// episode's calls.
func ParseSettlements(episode, h string) ([]ledger.Settlement, error) {
	if h == "" {
		return nil, nil
	}
	items := strings.Split(h, ",")
	if len(items) > maxSettlements {
		return nil, fmt.Errorf("%s: %d items, at most %d", HeaderSettled, len(items), maxSettlements)
	}
	out := make([]ledger.Settlement, 0, len(items))
	for _, it := range items {
		f := strings.Split(strings.TrimSpace(it), ".")
		if len(f) != 3 {
			return nil, fmt.Errorf("%s: item %q is not SEQ.N.D", HeaderSettled, it)
		}
		seq, err1 := strconv.ParseInt(f[0], 10, 64)
		n, err2 := strconv.ParseInt(f[1], 10, 64)
		if err1 != nil || err2 != nil || seq < 1 || n < 0 {
			return nil, fmt.Errorf("%s: item %q: SEQ must be a positive integer and N one of at least 0", HeaderSettled, it)
		}
		var d ledger.Disposition
		switch f[2] {
		case "d":
			d = ledger.Delivered
		case "a":
			d = ledger.Abandoned
		default:
			return nil, fmt.Errorf("%s: item %q: D must be d (delivered) or a (abandoned)", HeaderSettled, it)
		}
		if n == 0 && d != ledger.Abandoned {
			return nil, fmt.Errorf("%s: item %q: a response no call read (N 0) can only be abandoned", HeaderSettled, it)
		}
		id := ""
		if n > 0 {
			id = episode + "/" + strconv.FormatInt(n, 10)
		}
		out = append(out, ledger.Settlement{Seq: seq, CallID: id, Disposition: d})
	}
	return out, nil
}

// outbox holds the settlements the gateway has not recorded yet: unsent
// ones, and those riding on calls in flight (carried), recorded when the
// call's answer says so and sent again otherwise. It says when a flush of
// its own is to be scheduled (one at a time). Like order it does no I/O;
// the Relay uses it under its mutex.
type outbox struct {
	unsent, carried []settlement
	flushing        bool // a flush of unsent is scheduled
}

// add queues settlements to send.
func (b *outbox) add(s ...settlement) { b.unsent = append(b.unsent, s...) }

// pending reports settlements not sent.
func (b *outbox) pending() bool { return len(b.unsent) > 0 }

// take moves the unsent settlements to the carried ones, for a request
// about to go upstream.
func (b *outbox) take() []settlement {
	s := b.unsent
	b.unsent = nil
	b.carried = append(b.carried, s...)
	return s
}

// returned ends the ride of s: recorded, they are done; otherwise they
// wait for the next call or flush, before those queued since.
func (b *outbox) returned(s []settlement, recorded bool) {
	keep := b.carried[:0]
	for _, c := range b.carried {
		if !containsSettlement(s, c) {
			keep = append(keep, c)
		}
	}
	b.carried = keep
	if !recorded {
		b.unsent = append(append([]settlement(nil), s...), b.unsent...)
	}
}

// batch takes the unsent settlements for a flush of their own, with all
// also those riding on calls in flight (which may wait long for their
// model).
func (b *outbox) batch(all bool) []settlement {
	s := append([]settlement(nil), b.unsent...)
	if all {
		s = append(s, b.carried...)
	}
	b.unsent = b.unsent[:0]
	return s
}

// failed puts back the settlements of a batch the gateway did not record,
// but those a call in flight carries.
func (b *outbox) failed(s []settlement) {
	for _, x := range s {
		if !containsSettlement(b.carried, x) {
			b.unsent = append(b.unsent, x)
		}
	}
}

// schedule reports whether a flush is to be scheduled now: none is.
func (b *outbox) schedule() bool {
	if b.flushing {
		return false
	}
	b.flushing = true
	return true
}

// flushed ends a scheduled flush; it reports whether another is due (what
// came meanwhile, or failed).
func (b *outbox) flushed() bool {
	b.flushing = false
	return b.pending()
}

func containsSettlement(s []settlement, x settlement) bool {
	for _, y := range s {
		if y == x {
			return true
		}
	}
	return false
}

// takeSettlements takes the unsent settlements for a request about to go
// upstream.
func (r *Relay) takeSettlements() []settlement {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.out.take()
}

// returnSettlements ends the ride of s: recorded, they are done; otherwise
// they wait for the next call or flush.
func (r *Relay) returnSettlements(s []settlement, recorded bool) {
	if len(s) == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.out.returned(s, recorded)
	if !recorded {
		r.scheduleFlushLocked()
	}
}

// scheduleFlushLocked sends the unsent settlements on their own after
// SettleDelay, unless a call takes them first. r.mu is held.
func (r *Relay) scheduleFlushLocked() {
	if !r.out.schedule() {
		return
	}
	r.clock.AfterFunc(r.cfg.SettleDelay, func() {
		ctx, cancel := withTimeout(context.Background(), r.clock, 30*time.Second)
		defer cancel()
		err := r.flushSettlements(ctx, false)
		if err != nil {
			r.log.Debug("settlements not recorded yet; they ride on the next call", "err", err)
		}
		// One flush at a time: what came meanwhile (or failed) goes in the
		// next one.
		r.mu.Lock()
		if r.out.flushed() {
			r.scheduleFlushLocked()
		}
		r.mu.Unlock()
	})
}

// flushSettlements has the gateway record the unsent settlements (with
// all, also those riding on calls in flight, which may wait long for
// their model) in one request.
func (r *Relay) flushSettlements(ctx context.Context, all bool) error {
	r.mu.Lock()
	s := r.out.batch(all)
	cred := r.cred
	r.mu.Unlock()
	if len(s) == 0 {
		return nil
	}
	err := r.postSettlements(ctx, cred, s)
	if err != nil {
		r.mu.Lock()
		r.out.failed(s)
		r.mu.Unlock()
	}
	return err
}

func (r *Relay) postSettlements(ctx context.Context, cred Credentials, s []settlement) error {
	wait := r.cfg.Retry.Initial
	for {
		up := r.up.Load()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, up.Base+settlePath, nil)
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+cred.Token)
		req.Header.Set(HeaderAttempt, strconv.Itoa(cred.Attempt))
		req.Header.Set(HeaderEpisode, cred.Episode)
		req.Header.Set(HeaderSettled, formatSettlements(s))
		resp, err := up.Client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.Header.Get(HeaderSettledOK) != "" {
				return nil
			}
			if resp.StatusCode == http.StatusNotFound {
				return nil // an upstream without a ledger (a model server)
			}
			if resp.StatusCode/100 == 4 {
				// Refused (a stale attempt, an unknown token): sending it
				// again changes nothing.
				return fmt.Errorf("gateway refused the settlements: %s", resp.Status)
			}
			err = fmt.Errorf("gateway answered %s", resp.Status)
		}
		if !sleep(ctx, r.clock, jitter(wait)) {
			return fmt.Errorf("settlements: %w", err)
		}
		wait = min(2*wait, r.cfg.Retry.MaxInterval)
	}
}
