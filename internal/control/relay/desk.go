package relay

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// desk decides the gateway's call path: which request is admitted (a known
// token, not revoked, on its own sandbox's socket, of the episode's
// current attempt, with a well-formed call id and body), which waits for
// the answer under way to the same call id, which is answered from the
// ledger and which is refused as a call id reused, and what becomes of the
// model's answer (recorded, passed on, refused). It knows the episodes, by
// id and by token, and the calls being answered.
//
// It does no I/O and never waits: the Gateway reads files, opens ledgers,
// calls the model and writes answers, and asks the desk under its mutex.
// Tests step it directly.
type desk struct {
	episodes  map[string]EpisodeState
	tokens    map[string]string // token → episode
	answering map[string]bool   // episode\x00call id being answered
}

func newDesk() *desk {
	return &desk{episodes: map[string]EpisodeState{}, tokens: map[string]string{}, answering: map[string]bool{}}
}

// put registers an episode, or its new state (a token it had before is
// forgotten).
func (d *desk) put(st EpisodeState) {
	if old, ok := d.episodes[st.Episode]; ok {
		delete(d.tokens, old.Token)
	}
	d.episodes[st.Episode] = st
	d.tokens[st.Token] = st.Episode
}

// episode returns an episode's state.
func (d *desk) episode(id string) (EpisodeState, bool) {
	st, ok := d.episodes[id]
	return st, ok
}

// remove forgets an episode and its token.
func (d *desk) remove(id string) {
	if st, ok := d.episodes[id]; ok {
		delete(d.tokens, st.Token)
	}
	delete(d.episodes, id)
}

// knows reports whether token is an episode's (the gateway reads the
// episode files again before it refuses one it does not know: another
// process may have added the episode).
func (d *desk) knows(token string) bool {
	_, ok := d.tokens[token]
	return ok
}

// refusal is an answer the gateway gives instead of the model's.
type refusal struct {
	status int
	typ    string // the OpenAI error type
	msg    string
	kind   refusalKind // the metric it counts in
}

type refusalKind int

const (
	refusedOther        refusalKind = iota
	refusedUnauthorized             // unknown, revoked or misplaced token
	refusedBad                      // a malformed or oversized call
	refusedStale                    // an older attempt
)

func (r *refusal) String() string { return fmt.Sprintf("%d %s: %s", r.status, r.typ, r.msg) }

func unauthorized() *refusal {
	return &refusal{http.StatusUnauthorized, "authentication_error", "unknown or missing episode token", refusedUnauthorized}
}

func badRequest(format string, args ...any) *refusal {
	return &refusal{http.StatusBadRequest, "invalid_request_error", fmt.Sprintf(format, args...), refusedBad}
}

// serverError refuses a call the gateway could not handle (its ledger).
func serverError(msg string) *refusal {
	return &refusal{http.StatusInternalServerError, "server_error", msg, refusedOther}
}

// request is what the desk reads of a relay's request.
type request struct {
	authorization string // the Authorization header
	sandbox       string // the sandbox whose own socket it came in on
	onSocket      bool   // it came in on a sandbox's own socket
	attempt       string // HeaderAttempt
	callID        string // HeaderCallID
}

// authenticate finds the episode of the bearer token: a known one, not
// revoked, and, on a sandbox's own socket, bound to that sandbox.
func (d *desk) authenticate(q request) (EpisodeState, *refusal) {
	tok, ok := strings.CutPrefix(q.authorization, "Bearer ")
	id, known := d.tokens[tok]
	if !ok || tok == "" || !known {
		return EpisodeState{}, unauthorized()
	}
	st := d.episodes[id]
	if st.Revoked || (q.onSocket && st.Sandbox != q.sandbox) {
		return EpisodeState{}, unauthorized()
	}
	return st, nil
}

// admit authenticates a relay's request and fences it by attempt: only
// the episode's current attempt is admitted.
func (d *desk) admit(q request) (EpisodeState, *refusal) {
	st, ref := d.authenticate(q)
	if ref != nil {
		return st, ref
	}
	attempt, err := strconv.Atoi(q.attempt)
	if err != nil {
		return st, badRequest("missing or bad %s header", HeaderAttempt)
	}
	if attempt != st.Attempt {
		return st, &refusal{http.StatusConflict, "stale_attempt", fmt.Sprintf("stale attempt %d: episode %s is at attempt %d", attempt, st.Episode, st.Attempt), refusedStale}
	}
	return st, nil
}

// admitCall is admit for a model call, which also names its call id,
// EPISODE/N.
func (d *desk) admitCall(q request) (EpisodeState, *refusal) {
	st, ref := d.admit(q)
	if ref != nil {
		return st, ref
	}
	if n, ok := strings.CutPrefix(q.callID, st.Episode+"/"); !ok || n == "" {
		return st, badRequest("%s %q must be %s/N", HeaderCallID, q.callID, st.Episode)
	}
	return st, nil
}

// checkBody judges a call's body as read (err from the read, limited to
// maxBody). It is a cheap check: the model server judges the rest (and
// answers 400), and the ledger validates whatever it records.
func (d *desk) checkBody(body []byte, err error, maxBody int64) *refusal {
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return &refusal{http.StatusRequestEntityTooLarge, "invalid_request_error", fmt.Sprintf("request body over %d bytes", maxBody), refusedBad}
	case err != nil:
		return badRequest("read request: %s", err)
	}
	if t := bytes.TrimLeft(body, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return badRequest("request body must be a JSON object")
	}
	return nil
}

// callKey names call id callID of an episode among the calls being
// answered.
func callKey(episode, callID string) string { return episode + "\x00" + callID }

// claim reports whether the call named key may be answered now: one
// answer per call id at a time, so a duplicate that arrives while the
// first is answered waits for it (and is then answered from the ledger).
// A claim granted lasts until done.
func (d *desk) claim(key string) bool {
	if d.answering[key] {
		return false
	}
	d.answering[key] = true
	return true
}

// done ends the claim on key.
func (d *desk) done(key string) { delete(d.answering, key) }

// needsMatch reports whether a call of a relaunched episode is first
// matched against the ledger (which cuts what the harness never acted on).
func (d *desk) needsMatch(st EpisodeState, path string) bool {
	return st.NeedMatch && path == "/v1/chat/completions"
}

// matched records that the relaunched episode's first call was matched,
// unless a restore moved the episode past that call's attempt meanwhile.
// It returns the state to save.
func (d *desk) matched(id string, attempt int) (EpisodeState, bool) {
	st, ok := d.episodes[id]
	if !ok || st.Attempt != attempt {
		return st, false
	}
	st.NeedMatch = false
	d.episodes[id] = st
	return st, true
}

// replay judges a call whose id the ledger holds already (recorded is the
// request recorded): the same request is answered from the ledger
// (nil); another one is refused, a call id reused.
func (d *desk) replay(callID string, recorded, body []byte) *refusal {
	if requestHash(recorded) != requestHash(body) {
		return &refusal{http.StatusConflict, "call_id_reused", fmt.Sprintf("call id %s is already recorded with another request", callID), refusedOther}
	}
	return nil
}

// outcome is what becomes of the model server's answer.
type outcome int

const (
	outcomeRecord outcome = iota // a response: appended to the ledger, then answered from its entry
	outcomePassOn                // the model's refusal (not 2xx): passed on as it came, not recorded
	outcomeRefuse                // no usable answer: the gateway's refusal instead
)

// judge judges the model server's answer to a call: err when there
// was none, else its status, Content-Type and body. With outcomeRecord it
// returns the response to record: the body, or a stream of chat chunks
// assembled into one completion.
func (d *desk) judge(err error, status int, contentType string, body []byte) (outcome, []byte, *refusal) {
	switch {
	case err != nil:
		return outcomeRefuse, nil, &refusal{http.StatusBadGateway, "upstream_error", err.Error(), refusedOther}
	case status/100 != 2:
		return outcomePassOn, body, nil
	case strings.HasPrefix(contentType, "text/event-stream"):
		evs, err := ParseSSE(bytes.NewReader(body))
		if err == nil {
			body, err = AssembleChat(evs)
		}
		if err != nil {
			return outcomeRefuse, nil, &refusal{http.StatusBadGateway, "upstream_error", "model stream: " + err.Error(), refusedOther}
		}
	}
	return outcomeRecord, body, nil
}
