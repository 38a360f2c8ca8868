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
	c.n = r.order.number()
	r.mu.Unlock()
	if c.stream {
		r.serveStream(w, q, c, start)
	} else {
		r.serveWhole(w, q, c, start)
	}
}

// observeAdded records the time call c, which came in at start, spent in
// the relay beyond its upstream round trip.
func (r *Relay) observeAdded(c *call, start time.Time) {
	r.m.added.Observe((r.clock.Now().Sub(start) - c.res.took).Seconds())
}

// serveWhole answers a call that is not streamed. Nothing goes to the
// client before its response, so the handler takes the call through run
// itself.
func (r *Relay) serveWhole(w http.ResponseWriter, q *http.Request, c *call, start time.Time) {
	c.handover = func() bool { return q.Context().Err() == nil && r.deliver(w, nil, c) }
	r.run(c)
	if c.err != nil {
		apiError(w, http.StatusBadGateway, "upstream_error", c.err.Error())
		return
	}
	r.observeAdded(c, start)
}

// serveStream answers a streamed call. The client gets its status and
// headers at once, and comments while the response is stored or held: its
// first-byte and idle timeouts see a live stream, as they would from the
// model. run goes on in a goroutine of its own; the handler delivers when
// run hands it the response.
func (r *Relay) serveStream(w http.ResponseWriter, q *http.Request, c *call, start time.Time) {
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
		sse.fail(c.path, http.StatusBadGateway, errorJSON("upstream_error", "bad_gateway", c.err.Error()))
		return
	}
	c.done <- q.Context().Err() == nil && r.deliver(w, sse, c)
	r.observeAdded(c, start)
}

// run takes a call from the hold to its settlement. The order decides each
// step; run does the I/O and the waiting between them.
func (r *Relay) run(c *call) {
	var took time.Duration
	for {
		ctx, cancel, gen, cred, ok := r.admit(c)
		if !ok {
			r.m.dropped.Inc()
			return
		}
		res, err := r.issue(ctx, c.path, c.body, c.n, cred)
		cancel()
		took += res.took
		res.took = took
		a := answer{failed: err != nil, recorded: res.status/100 == 2, seq: res.seq, before: res.before}
		a.stale = !a.failed && staleAttempt(res)
		r.mu.Lock()
		delete(r.cancels, c.n)
		v, wake := r.order.answered(gen, a)
		if wake {
			r.broadcastLocked()
		}
		switch v {
		case verdictReissue: // restored meanwhile: issue again under the new attempt
			r.mu.Unlock()
			releaseBody(res.buf)
			r.m.reissues.Inc()
			continue
		case verdictHoldRetry:
			// The call waits for the release and is issued again then
			// (under the new attempt, when there is one).
			r.log.Info("upstream failed during a hold: the call waits for the continue", "call", c.n, "err", err, "status", res.status)
			releaseBody(res.buf)
			r.m.held.Inc()
			for !r.order.retryable(gen) {
				r.waitLocked(nil)
			}
			r.m.held.Dec()
			r.mu.Unlock()
			r.m.reissues.Inc()
			continue
		case verdictFail:
			// The gateway may have recorded an answer this call never
			// read: answered woke the waiters, which may now see that no
			// call can fill the gap.
			c.err = err
			close(c.ready)
			r.mu.Unlock()
			return
		}
		t := r.awaitTurn(c, gen, a)
		switch t.verdict {
		case turnReissue:
			r.mu.Unlock()
			releaseBody(res.buf)
			r.m.reissues.Inc()
			continue
		case turnAbandon:
			if t.settles {
				r.settledLocked(r.order.settle(c.n, res.seq, false))
			}
			r.mu.Unlock()
			releaseBody(res.buf)
			return
		}
		r.handOver(c, res, t.settles)
		return
	}
}

// admit waits until the order lets call c go upstream: it returns the
// context the call goes under (a restore cancels it), the generation and
// the credentials, or false when the client has gone first (the call is
// never sent, so nothing is recorded for it).
func (r *Relay) admit(c *call) (ctx context.Context, cancel context.CancelFunc, gen int, cred Credentials, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	waited := false
	defer func() {
		if waited {
			r.m.held.Dec()
		}
	}()
	for {
		a, gen := r.order.admit(c.client.Err() != nil)
		switch a {
		case admitDrop:
			return nil, nil, 0, Credentials{}, false
		case admitIssue:
			// Not the client's context: once issued, a call runs to its
			// end even if the harness goes away, so the relay learns its
			// ledger position and settles it in order. Only a restore
			// cancels it.
			ctx, cancel := context.WithCancel(context.Background())
			r.cancels[c.n] = cancel
			return ctx, cancel, gen, r.cred, true
		}
		if !waited {
			r.m.held.Inc()
			waited = true
		}
		r.waitLocked(c.client.Done())
	}
}

// awaitTurn waits, with r.mu held, until the order says what becomes of
// call c's queued answer a: its turn has come (the delivery is then under
// way), it is to be issued again, or its client has gone.
func (r *Relay) awaitTurn(c *call, gen int, a answer) turn {
	waited := false
	for {
		t := r.order.deliver(gen, a, c.client.Err() != nil)
		if len(t.orphans) > 0 {
			r.log.Warn("ledger entries no call read (their calls failed): settled as abandoned", "from", t.orphans[0].seq, "to", t.orphans[len(t.orphans)-1].seq)
			r.m.abandoned.Add(float64(len(t.orphans)))
			r.out.add(t.orphans...)
			r.scheduleFlushLocked()
		}
		if t.verdict != turnWait {
			if waited {
				r.m.held.Dec()
			}
			return t
		}
		if !waited {
			r.m.held.Inc()
			waited = true
		}
		r.waitLocked(nil)
	}
}

// handOver has call c's response delivered, by run's own goroutine or by
// the streaming handler, and settles it. r.mu is held on entry and
// released.
func (r *Relay) handOver(c *call, res result, settles bool) {
	c.res, c.handed = res, true
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
	defer r.mu.Unlock()
	if s, moved := r.order.delivered(c.n, res.seq, settles, ok); moved {
		r.settledLocked(s)
	} else if r.order.idle() {
		r.broadcastLocked()
	}
}

// settledLocked acts on a settlement the order made: it counts it, has the
// gateway record it (when the upstream keeps a ledger) and wakes the
// waiters, whose turn may have come. r.mu is held.
func (r *Relay) settledLocked(s settlement) {
	if s.disp == dispDelivered {
		r.m.delivered.Inc()
	} else {
		r.m.abandoned.Inc()
		r.log.Info("response abandoned: the client had gone before it got it", "call", s.n, "seq", s.seq)
	}
	if s.seq > 0 {
		r.out.add(s)
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
	for try := 0; ; try++ {
		t0 := r.clock.Now()
		up := r.up.Load()
		req, err := r.newRequest(ctx, up, path, body, n, cred)
		if err != nil {
			return res, err
		}
		resp, b, buf, err := r.send(up, req)
		res.took += r.clock.Now().Sub(t0)
		var d time.Duration // the wait before the next try
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			if try >= r.cfg.Retry.Max {
				return res, err
			}
			d = jitter(wait)
		case len(b) > maxResponse:
			releaseBody(buf)
			return res, fmt.Errorf("upstream response over %d bytes", maxResponse)
		case (resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500) && try < r.cfg.Retry.Max:
			releaseBody(buf)
			d = jitter(wait)
			if ra, _ := retryafter.Parse(resp.Header.Get("Retry-After"), r.clock.Now()); ra > 0 {
				d = min(ra, r.cfg.Retry.MaxInterval*6)
			}
			r.log.Debug("upstream busy, retrying", "status", resp.StatusCode, "in", d, "try", try+1)
		default:
			return readAnswer(res, path, resp, b, buf)
		}
		r.m.retries.Inc()
		wait = min(2*wait, r.cfg.Retry.MaxInterval)
		if !sleep(ctx, r.clock, d) {
			return res, ctx.Err()
		}
	}
}

// newRequest makes one try of call n to path.
func (r *Relay) newRequest(ctx context.Context, up *Upstream, path string, body []byte, n int64, cred Credentials) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, up.Base+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+cred.Token)
	req.Header.Set(HeaderCallID, cred.Episode+"/"+strconv.FormatInt(n, 10))
	req.Header.Set(HeaderAttempt, strconv.Itoa(cred.Attempt))
	req.Header.Set(HeaderEpisode, cred.Episode)
	return req, nil
}

// send sends one try upstream, with the settlements not yet recorded
// riding along, and reads the answer whole (into a pooled buffer, one byte
// over maxResponse at most).
func (r *Relay) send(up *Upstream, req *http.Request) (*http.Response, []byte, *[]byte, error) {
	carried := r.takeSettlements()
	if len(carried) > 0 {
		req.Header.Set(HeaderSettled, formatSettlements(carried))
	}
	r.mu.Lock()
	base := r.order.wantsBase()
	r.mu.Unlock()
	if base {
		req.Header.Set(HeaderWantBase, "1")
	}
	resp, err := up.Client.Do(req)
	if err != nil {
		r.returnSettlements(carried, false)
		return nil, nil, nil, fmt.Errorf("upstream %s: %w", up.Raw, err)
	}
	r.returnSettlements(carried, resp.Header.Get(HeaderSettledOK) != "")
	b, buf, err := readPooled(io.LimitReader(resp.Body, maxResponse+1), resp.ContentLength)
	resp.Body.Close()
	if err != nil {
		releaseBody(buf)
		return nil, nil, nil, fmt.Errorf("upstream %s: read: %w", up.Raw, err)
	}
	return resp, b, buf, nil
}

// readAnswer fills res with an answer to path read whole: status, header
// and body (a chat stream assembled into one completion), and the ledger
// position and deliveries before it that the gateway gave.
func readAnswer(res result, path string, resp *http.Response, b []byte, buf *[]byte) (result, error) {
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
