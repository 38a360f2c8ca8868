package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"stasis/internal/eventstream"
	"stasis/internal/retryafter"
)

// A call is one model call of the harness, from its request to its
// settlement. run issues it upstream, waits for its turn in ledger order,
// has it delivered and settles it. A call that is not streamed runs in its
// handler's goroutine, which delivers the response when its turn comes. A
// streamed one has two: the handler answers the harness (headers at once,
// heartbeats while it waits, then the events) and run goes on alone, so
// it never depends on the handler being there: a client that leaves is
// noticed, its call is not sent upstream if it was not yet, and its
// response, if recorded, is settled as abandoned.
type call struct {
	n            int64
	path         string
	body         []byte // what goes upstream
	stream       bool
	includeUsage bool
	client       context.Context

	// Under Relay.mu:
	ready  chan struct{} // closed when res or err is set
	handed bool          // res is to be delivered: the handler must answer done
	res    result
	err    error
	// done carries the handler's verdict on a handed delivery: true when
	// the whole response was written and flushed.
	done chan bool
	// handover, when set, delivers the response in run's own goroutine
	// (the handler's: a call that is not streamed has nothing to send while
	// it waits) and reports the verdict; ready and done are then unused.
	handover func() bool
}

type result struct {
	status int
	header http.Header
	body   []byte
	buf    *[]byte // the pooled buffer body was read into, if it was
	seq    int64   // ledger position from the gateway; 0 when none
	// before is, for a relaunched relay's first recorded answer, the
	// deliveries the ledger holds before seq (-1: not said).
	before int64
	took   time.Duration
}

// streamable are the endpoints the relay can answer as a stream: it stores
// the whole response and re-chunks it in the endpoint's own event format.
var streamable = map[string]bool{"/v1/chat/completions": true, "/v1/responses": true, "/v1/completions": true}

// parseOther checks the body of a call to a model endpoint the relay does
// not re-chunk: it goes upstream byte for byte, so it must be JSON and must
// not ask for a stream.
func parseOther(path string, body []byte) error {
	if t := bytes.TrimLeft(body, " \t\r\n"); len(t) == 0 || t[0] != '{' || !json.Valid(body) {
		return errors.New("request body must be a JSON object")
	}
	var head struct {
		Stream bool `json:"stream"`
	}
	_ = json.Unmarshal(body, &head)
	if head.Stream {
		return fmt.Errorf("POST %s with \"stream\": true: the relay stores each response whole before the harness gets it and can re-chunk only /v1/chat/completions, /v1/responses and /v1/completions; ask this endpoint without a stream", path)
	}
	return nil
}

func (r *Relay) serveCall(w http.ResponseWriter, q *http.Request, path string) {
	start := r.clock.Now()
	body, bodyBuf, err := readPooled(http.MaxBytesReader(w, q.Body, r.cfg.MaxBody), q.ContentLength)
	defer releaseBody(bodyBuf)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			apiError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", fmt.Sprintf("request body over %d bytes", r.cfg.MaxBody))
			return
		}
		apiError(w, http.StatusBadRequest, "invalid_request_error", "read request: "+err.Error())
		return
	}
	c := &call{path: path, client: q.Context(), ready: make(chan struct{})}
	if streamable[path] {
		c.body, c.stream, c.includeUsage, err = ParseCall(body)
	} else {
		err = parseOther(path, body)
		c.body = append([]byte(nil), body...)
	}
	if err != nil {
		apiError(w, http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	r.m.calls.Inc()
	r.mu.Lock()
	r.next++
	c.n = r.next
	r.mu.Unlock()

	if !c.stream {
		// Nothing goes to the client before its response, so the handler
		// takes the call through run itself.
		c.handover = func() bool { return q.Context().Err() == nil && r.deliver(w, nil, c) }
		r.run(c)
		if c.err != nil {
			apiError(w, http.StatusBadGateway, "upstream_error", c.err.Error())
			return
		}
		r.m.added.Observe((r.clock.Now().Sub(start) - c.res.took).Seconds())
		return
	}
	// A streaming client gets its status and headers at once, and comments
	// while the response is stored or held: its first-byte and idle
	// timeouts see a live stream, as they would from the model.
	c.done = make(chan bool, 1)
	sse := startStream(w)
	tick := newTicker(r.clock, r.cfg.Heartbeat)
	defer tick.Stop()
	go r.run(c)
	for waiting := true; waiting; {
		select {
		case <-c.ready:
			waiting = false
		case <-tick.C:
			if sse.Comment("keep-alive") == nil {
				r.m.heartbeats.Inc()
			}
		case <-q.Context().Done():
			r.mu.Lock()
			if !c.handed && c.err == nil {
				// run sees the client has gone: it never sends the call,
				// or settles its response as abandoned.
				r.mu.Unlock()
				return
			}
			r.mu.Unlock()
			<-c.ready
			waiting = false
		}
	}
	if c.err != nil {
		sse.fail(path, http.StatusBadGateway, errorJSON("upstream_error", "bad_gateway", c.err.Error()))
		return
	}
	ok := q.Context().Err() == nil && r.deliver(w, sse, c)
	c.done <- ok
	r.m.added.Observe((r.clock.Now().Sub(start) - c.res.took).Seconds())
}

// run takes a call from the hold to its settlement.
func (r *Relay) run(c *call) {
	var took time.Duration
	for {
		r.mu.Lock()
		if r.held {
			r.m.held.Inc()
			ok := r.waitLocked(c.client.Done(), func() bool { return !r.held })
			r.m.held.Dec()
			if !ok {
				r.mu.Unlock()
				r.m.dropped.Inc()
				return
			}
		}
		if c.client.Err() != nil {
			// The client has gone: the call is never sent, so nothing is
			// recorded for it.
			r.mu.Unlock()
			r.m.dropped.Inc()
			return
		}
		gen, cred := r.gen, r.cred
		// Not the client's context: once issued, a call runs to its end even
		// if the harness goes away, so the relay learns its ledger position
		// and settles it in order. Only a restore cancels it.
		ctx, cancel := context.WithCancel(context.Background())
		r.cancels[c.n] = cancel
		r.mu.Unlock()

		res, err := r.issue(ctx, c.path, c.body, c.n, cred)
		cancel()
		took += res.took
		res.took = took
		r.mu.Lock()
		delete(r.cancels, c.n)
		if r.gen != gen {
			r.mu.Unlock()
			releaseBody(res.buf)
			r.m.reissues.Inc()
			continue // restored meanwhile: issue again under the new attempt
		}
		if r.held && (err != nil || staleAttempt(res)) {
			// A hold is where a checkpoint happens, and a restore from
			// it breaks the upstream connection (a new machine) or raises
			// the attempt at the gateway before the relay learns it at
			// the continue. Neither is the harness's to see: the call
			// waits for the release and is issued again then (under the
			// new attempt, when there is one).
			r.log.Info("upstream failed during a hold: the call waits for the continue", "call", c.n, "err", err, "status", res.status)
			releaseBody(res.buf)
			r.m.held.Inc()
			ok := r.waitLocked(nil, func() bool { return !r.held || r.gen != gen })
			r.m.held.Dec()
			r.mu.Unlock()
			if ok {
				r.m.reissues.Inc()
			}
			continue
		}
		if err != nil {
			c.err = err
			close(c.ready)
			// The gateway may have recorded an answer this call never
			// read: a waiter may now see that no call can fill the gap.
			r.broadcastLocked()
			r.mu.Unlock()
			return
		}
		recorded := res.status/100 == 2
		if r.baseUnknown && recorded && res.seq > 0 {
			r.pos, r.baseUnknown = res.seq-1, false
			r.deliv = r.pos
			if res.before >= 0 {
				r.deliv = res.before
			}
		}
		// Wait for the hold to end and for earlier ledger entries to be
		// settled first.
		if recorded && res.seq > 0 {
			r.waiting[res.seq]++
		}
		waited := false
		r.waitLocked(nil, func() bool {
			if r.gen != gen || (!r.held && (!recorded || res.seq <= r.pos+1 || r.skipOrphansLocked(res.seq))) {
				return true
			}
			if !waited {
				r.m.held.Inc()
				waited = true
			}
			return false
		})
		if waited {
			r.m.held.Dec()
		}
		if recorded && res.seq > 0 {
			if r.waiting[res.seq]--; r.waiting[res.seq] <= 0 {
				delete(r.waiting, res.seq)
			}
		}
		if r.gen != gen {
			r.mu.Unlock()
			releaseBody(res.buf)
			r.m.reissues.Inc()
			continue
		}
		// The entry this call settles: the next one in the ledger (seq 0
		// when the upstream keeps no ledger). An answer at or below the
		// position is a repeat of one already settled.
		settles := recorded && (res.seq == 0 || res.seq == r.pos+1)
		if c.client.Err() != nil {
			if settles {
				r.settleLocked(c, res.seq, false)
			}
			r.mu.Unlock()
			releaseBody(res.buf)
			return
		}
		c.res, c.handed = res, true
		r.delivering++
		var ok bool
		if c.handover != nil {
			r.mu.Unlock()
			ok = c.handover()
		} else {
			close(c.ready)
			r.mu.Unlock()
			ok = <-c.done
		}
		releaseBody(res.buf)
		r.mu.Lock()
		r.delivering--
		if settles {
			r.settleLocked(c, res.seq, ok)
		} else if r.delivering == 0 {
			r.broadcastLocked()
		}
		r.mu.Unlock()
		return
	}
}

// skipOrphansLocked handles a gap below seq that no call can fill: the
// gateway recorded answers (entries pos+1 .. seq-1) that no call of this
// relay read, because every try to read them failed and their calls gave
// up with an error. When seq is the lowest position any call waits at and
// no call is with the upstream (which could still come back with one of
// those positions), they are settled as abandoned, by position alone, and
// the position moves past them. r.mu is held.
func (r *Relay) skipOrphansLocked(seq int64) bool {
	if seq <= r.pos+1 || len(r.cancels) > 0 {
		return false
	}
	for s := range r.waiting {
		if s < seq {
			return false
		}
	}
	r.log.Warn("ledger entries no call read (their calls failed): settled as abandoned", "from", r.pos+1, "to", seq-1)
	for s := r.pos + 1; s < seq; s++ {
		r.pos++
		r.m.abandoned.Inc()
		r.unsent = append(r.unsent, settlement{seq: s, disp: dispAbandoned})
	}
	r.scheduleFlushLocked()
	return true
}

// settleLocked records that the response of call c, the ledger's entry at
// seq (0: no ledger), was delivered or abandoned, and moves the position
// on. r.mu is held.
func (r *Relay) settleLocked(c *call, seq int64, delivered bool) {
	r.pos++
	disp := dispAbandoned
	if delivered {
		r.deliv++
		r.m.delivered.Inc()
		disp = dispDelivered
	} else {
		r.m.abandoned.Inc()
		r.log.Info("response abandoned: the client had gone before it got it", "call", c.n, "seq", seq)
	}
	if seq > 0 {
		r.unsent = append(r.unsent, settlement{seq: seq, n: c.n, disp: disp})
		r.scheduleFlushLocked()
	}
	r.broadcastLocked()
}

// deliver writes a whole response to the harness and reports whether all
// of it was written and flushed.
func (r *Relay) deliver(w http.ResponseWriter, sse *streamWriter, c *call) bool {
	res := c.res
	if res.status/100 != 2 {
		if sse != nil {
			return sse.fail(c.path, res.status, res.body)
		}
		for _, h := range []string{"Content-Type", "Retry-After"} {
			if v := res.header.Get(h); v != "" {
				w.Header().Set(h, v)
			}
		}
		w.WriteHeader(res.status)
		if _, err := w.Write(res.body); err != nil {
			return false
		}
		return http.NewResponseController(w).Flush() == nil
	}
	if sse == nil {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(res.body)))
		if _, err := w.Write(res.body); err != nil {
			return false
		}
		return http.NewResponseController(w).Flush() == nil
	}
	var out []byte
	var err error
	switch c.path {
	case "/v1/responses":
		out, err = ResponsesEvents(res.body)
	case "/v1/completions":
		out, err = CompletionChunks(res.body, c.includeUsage)
	default:
		out, err = ChatChunks(res.body, c.includeUsage)
	}
	if err != nil {
		sse.fail(c.path, http.StatusBadGateway, errorJSON("upstream_error", "bad_gateway", "upstream answer is not a "+strings.TrimPrefix(c.path, "/v1/")+" response: "+err.Error()))
		return false
	}
	return sse.Write(out) == nil
}

// streamWriter is the relay's event stream to a harness.
type streamWriter struct{ *eventstream.Writer }

func startStream(w http.ResponseWriter) *streamWriter {
	return &streamWriter{eventstream.Start(w)}
}

// fail ends the stream with the endpoint format's error event for an
// answer of status with body (an OpenAI error body, or any bytes). It
// reports whether the event was written; an error event is not a delivery
// of a recorded response in any case.
func (s *streamWriter) fail(path string, status int, body []byte) bool {
	var ev []byte
	if path == "/v1/responses" {
		ev = ResponsesStreamError(status, body, 0)
	} else {
		ev = ChatStreamError(status, body)
	}
	return s.Write(ev) == nil
}

// issue makes one call upstream, retrying 429 and 5xx with bounded
// exponential backoff and jitter, honouring Retry-After. Settlements not
// yet recorded ride along.
func (r *Relay) issue(ctx context.Context, path string, body []byte, n int64, cred Credentials) (result, error) {
	res := result{before: -1}
	wait := r.cfg.Retry.Initial
	// backoff waits d before the next try (false: ctx ended first), and
	// doubles the base wait up to its cap.
	backoff := func(d time.Duration) bool {
		r.m.retries.Inc()
		wait = min(2*wait, r.cfg.Retry.MaxInterval)
		return sleep(ctx, r.clock, d)
	}
	for try := 0; ; try++ {
		t0 := r.clock.Now()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.up.Base+path, bytes.NewReader(body))
		if err != nil {
			return res, err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+cred.Token)
		req.Header.Set(HeaderCallID, cred.Episode+"/"+strconv.FormatInt(n, 10))
		req.Header.Set(HeaderAttempt, strconv.Itoa(cred.Attempt))
		req.Header.Set(HeaderEpisode, cred.Episode)
		carried := r.takeSettlements()
		if len(carried) > 0 {
			req.Header.Set(HeaderSettled, formatSettlements(carried))
		}
		r.mu.Lock()
		base := r.baseUnknown
		r.mu.Unlock()
		if base {
			req.Header.Set(HeaderWantBase, "1")
		}
		resp, err := r.up.Client.Do(req)
		if err != nil {
			r.returnSettlements(carried, false)
			res.took += r.clock.Now().Sub(t0)
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			if try >= r.cfg.Retry.Max {
				return res, fmt.Errorf("upstream %s: %w", r.up.Base, err)
			}
			if !backoff(jitter(wait)) {
				return res, ctx.Err()
			}
			continue
		}
		r.returnSettlements(carried, resp.Header.Get(HeaderSettledOK) != "")
		b, buf, err := readPooled(io.LimitReader(resp.Body, maxResponse+1), resp.ContentLength)
		resp.Body.Close()
		res.took += r.clock.Now().Sub(t0)
		if err != nil {
			releaseBody(buf)
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			if try >= r.cfg.Retry.Max {
				return res, fmt.Errorf("upstream %s: read: %w", r.up.Base, err)
			}
			if !backoff(jitter(wait)) {
				return res, ctx.Err()
			}
			continue
		}
		if len(b) > maxResponse {
			releaseBody(buf)
			return res, fmt.Errorf("upstream response over %d bytes", maxResponse)
		}
		if (resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500) && try < r.cfg.Retry.Max {
			releaseBody(buf)
			d := jitter(wait)
			if ra, _ := retryafter.Parse(resp.Header.Get("Retry-After"), r.clock.Now()); ra > 0 {
				d = min(ra, r.cfg.Retry.MaxInterval*6)
			}
			r.log.Debug("upstream busy, retrying", "status", resp.StatusCode, "in", d, "try", try+1)
			if !backoff(d) {
				return res, ctx.Err()
			}
			continue
		}
		res.status, res.header, res.body, res.buf = resp.StatusCode, resp.Header, b, buf
		if resp.StatusCode/100 == 2 && strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") && path == "/v1/chat/completions" {
			evs, err := ParseSSE(bytes.NewReader(b))
			if err == nil {
				res.body, err = AssembleChat(evs)
			}
			if err != nil {
				return res, fmt.Errorf("upstream stream: %w", err)
			}
		}
		if s := resp.Header.Get(HeaderLedgerSeq); s != "" {
			res.seq, _ = strconv.ParseInt(s, 10, 64)
		}
		if s := resp.Header.Get(HeaderDeliveredBefore); s != "" {
			if v, err := strconv.ParseInt(s, 10, 64); err == nil && v >= 0 {
				res.before = v
			}
		}
		return res, nil
	}
}

// staleAttempt says whether the gateway refused a call for a stale
// attempt (HTTP 409, type stale_attempt).
func staleAttempt(res result) bool {
	if res.status != http.StatusConflict {
		return false
	}
	var e struct {
		Error struct {
			Type string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(res.body, &e) == nil && e.Error.Type == "stale_attempt"
}
