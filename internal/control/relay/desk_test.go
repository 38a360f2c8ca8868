package relay

import (
	"errors"
	"net/http"
	"strings"
	"testing"
)

// testDesk knows three episodes: ep (attempt 2, bound to sandbox sb),
// free (attempt 0, bound to none) and gone (revoked).
func testDesk() *desk {
	d := newDesk()
	d.put(EpisodeState{Episode: "ep", Token: "tok-ep", Attempt: 2, Sandbox: "sb"})
	d.put(EpisodeState{Episode: "free", Token: "tok-free"})
	d.put(EpisodeState{Episode: "gone", Token: "tok-gone", Revoked: true})
	return d
}

// refused checks a refusal against the status, error type and kind
// wanted (status 0: admitted), and that its message says msg.
func refused(t *testing.T, ref *refusal, status int, typ string, kind refusalKind, msg string) {
	t.Helper()
	if status == 0 {
		if ref != nil {
			t.Fatalf("refused: %v", ref)
		}
		return
	}
	if ref == nil || ref.status != status || ref.typ != typ || ref.kind != kind || !strings.Contains(ref.msg, msg) {
		t.Fatalf("refusal %+v; want %d %s (kind %d) saying %q", ref, status, typ, kind, msg)
	}
}

func TestDeskAdmitsACall(t *testing.T) {
	ok := request{authorization: "Bearer tok-ep", sandbox: "sb", onSocket: true, attempt: "2", callID: "ep/7"}
	with := func(change func(*request)) request {
		r := ok
		change(&r)
		return r
	}
	const auth, bad, stale = "authentication_error", "invalid_request_error", "stale_attempt"
	for _, c := range []struct {
		name    string
		r       request
		status  int
		typ     string
		kind    refusalKind
		msg     string
		episode string
	}{
		{"its own token on its own socket, its attempt", ok, 0, "", 0, "", "ep"},
		{"on the shared handler (no socket)", with(func(r *request) { r.onSocket, r.sandbox = false, "" }), 0, "", 0, "", "ep"},
		{"an unbound episode on the shared handler", request{authorization: "Bearer tok-free", attempt: "0", callID: "free/1"}, 0, "", 0, "", "free"},
		{"no token", with(func(r *request) { r.authorization = "" }), 401, auth, refusedUnauthorized, "unknown or missing episode token", ""},
		{"not a bearer token", with(func(r *request) { r.authorization = "Basic tok-ep" }), 401, auth, refusedUnauthorized, "episode token", ""},
		{"an empty bearer token", with(func(r *request) { r.authorization = "Bearer " }), 401, auth, refusedUnauthorized, "episode token", ""},
		{"an unknown token", with(func(r *request) { r.authorization = "Bearer tok-x" }), 401, auth, refusedUnauthorized, "episode token", ""},
		{"a revoked episode's token", request{authorization: "Bearer tok-gone", attempt: "0", callID: "gone/1"}, 401, auth, refusedUnauthorized, "episode token", ""},
		{"on another sandbox's socket", with(func(r *request) { r.sandbox = "sb2" }), 401, auth, refusedUnauthorized, "episode token", ""},
		{"an unbound episode on a sandbox's socket", request{authorization: "Bearer tok-free", sandbox: "sb", onSocket: true, attempt: "0", callID: "free/1"}, 401, auth, refusedUnauthorized, "episode token", ""},
		{"no attempt", with(func(r *request) { r.attempt = "" }), 400, bad, refusedBad, "missing or bad " + HeaderAttempt, ""},
		{"an attempt not a number", with(func(r *request) { r.attempt = "two" }), 400, bad, refusedBad, "missing or bad " + HeaderAttempt, ""},
		{"an older attempt", with(func(r *request) { r.attempt = "1" }), 409, stale, refusedStale, "stale attempt 1: episode ep is at attempt 2", ""},
		{"a later attempt", with(func(r *request) { r.attempt = "3" }), 409, stale, refusedStale, "stale attempt 3: episode ep is at attempt 2", ""},
		{"another episode's call id", with(func(r *request) { r.callID = "other/7" }), 400, bad, refusedBad, `X-Stasis-Call-Id "other/7" must be ep/N`, ""},
		{"a call id without a number", with(func(r *request) { r.callID = "ep/" }), 400, bad, refusedBad, "must be ep/N", ""},
		{"no call id", with(func(r *request) { r.callID = "" }), 400, bad, refusedBad, "must be ep/N", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			st, ref := testDesk().admitCall(c.r)
			refused(t, ref, c.status, c.typ, c.kind, c.msg)
			if c.status == 0 && st.Episode != c.episode {
				t.Fatalf("admitted as %q, want %q", st.Episode, c.episode)
			}
		})
	}
}

// TestDeskAdmitsSettlementsAndModels: settlements are fenced by attempt
// but name no call; the models list only needs a valid token.
func TestDeskAdmitsSettlementsAndModels(t *testing.T) {
	d := testDesk()
	r := request{authorization: "Bearer tok-free", attempt: "0"}
	if _, ref := d.admit(r); ref != nil {
		t.Fatalf("settlements without a call id: %v", ref)
	}
	r.attempt = "5"
	_, ref := d.admit(r)
	refused(t, ref, 409, "stale_attempt", refusedStale, "stale attempt 5")
	r.attempt = ""
	if st, ref := d.authenticate(r); ref != nil || st.Episode != "free" {
		t.Fatalf("the models list: %+v %v", st, ref)
	}
}

func TestDeskRegistry(t *testing.T) {
	d := testDesk()
	d.put(EpisodeState{Episode: "ep", Token: "tok-new", Attempt: 3})
	if d.knows("tok-ep") || !d.knows("tok-new") {
		t.Fatal("a new token must replace the episode's old one")
	}
	if st, ok := d.episode("ep"); !ok || st.Attempt != 3 {
		t.Fatalf("episode after put: %+v %v", st, ok)
	}
	d.remove("ep")
	if d.knows("tok-new") {
		t.Fatal("a removed episode's token is still known")
	}
	if _, ok := d.episode("ep"); ok {
		t.Fatal("a removed episode is still known")
	}
	_, ref := d.authenticate(request{authorization: "Bearer tok-new"})
	refused(t, ref, 401, "authentication_error", refusedUnauthorized, "episode token")
}

// TestDeskHoldsDuplicates: one answer per call id at a time.
func TestDeskHoldsDuplicates(t *testing.T) {
	d := newDesk()
	a, b := callKey("ep", "ep/1"), callKey("ep", "ep/2")
	steps := []struct {
		do   func() bool
		want bool
		what string
	}{
		{func() bool { return d.claim(a) }, true, "the first ep/1 is answered"},
		{func() bool { return d.claim(a) }, false, "a duplicate of ep/1 waits"},
		{func() bool { return d.claim(b) }, true, "ep/2 does not wait for ep/1"},
		{func() bool { return d.claim(callKey("ep2", "ep/1")) }, true, "another episode's ep/1 does not either"},
		{func() bool { d.done(a); return d.claim(a) }, true, "once ep/1 is answered, the duplicate goes"},
		{func() bool { return d.claim(a) }, false, "and holds the next one"},
	}
	for _, s := range steps {
		if got := s.do(); got != s.want {
			t.Fatalf("%s: claim %v", s.what, got)
		}
	}
}

func TestDeskMatchesARelaunch(t *testing.T) {
	d := testDesk()
	st := EpisodeState{Episode: "free", NeedMatch: true}
	for path, want := range map[string]bool{"/v1/chat/completions": true, "/v1/responses": false, "/v1/completions": false} {
		if got := d.needsMatch(st, path); got != want {
			t.Errorf("needsMatch %s: %v", path, got)
		}
	}
	if d.needsMatch(EpisodeState{}, "/v1/chat/completions") {
		t.Error("an episode not relaunched needs no match")
	}
	d.put(EpisodeState{Episode: "free", Token: "tok-free", Attempt: 1, NeedMatch: true})
	if _, ok := d.matched("free", 0); ok {
		t.Fatal("a match made under an attempt a restore has left behind was recorded")
	}
	if st, _ := d.episode("free"); !st.NeedMatch {
		t.Fatal("a stale match cleared NeedMatch")
	}
	st, ok := d.matched("free", 1)
	if now, _ := d.episode("free"); !ok || st.NeedMatch || now.NeedMatch {
		t.Fatalf("matched: %+v %v, desk %+v", st, ok, now)
	}
	if _, ok := d.matched("nobody", 0); ok {
		t.Fatal("an unknown episode matched")
	}
}

func TestDeskChecksBodies(t *testing.T) {
	d := newDesk()
	for _, c := range []struct {
		name   string
		body   string
		err    error
		status int
		msg    string
	}{
		{"an object", `{"messages":[]}`, nil, 0, ""},
		{"an object after blanks", " \n\t{}", nil, 0, ""},
		{"not JSON after its brace: the model judges", `{oops`, nil, 0, ""},
		{"empty", ``, nil, 400, "request body must be a JSON object"},
		{"a list", `[{}]`, nil, 400, "request body must be a JSON object"},
		{"over the limit", `{}`, &http.MaxBytesError{Limit: 64}, 413, "request body over 64 bytes"},
		{"a read that failed", `{}`, errors.New("connection reset"), 400, "read request: connection reset"},
	} {
		t.Run(c.name, func(t *testing.T) {
			typ := "invalid_request_error"
			refused(t, d.checkBody([]byte(c.body), c.err, 64), c.status, typ, refusedBad, c.msg)
		})
	}
}

func TestDeskReplays(t *testing.T) {
	d := newDesk()
	recorded := []byte(`{"messages":[{"role":"user","content":"hi"}]}`)
	if ref := d.replay("ep/1", recorded, []byte(`{ "messages": [ {"role":"user", "content":"hi"} ] }`)); ref != nil {
		t.Fatalf("the same request, spaced otherwise: %v", ref)
	}
	ref := d.replay("ep/1", recorded, []byte(`{"messages":[]}`))
	refused(t, ref, 409, "call_id_reused", refusedOther, "call id ep/1 is already recorded with another request")
}

func TestDeskJudgesTheModelsAnswer(t *testing.T) {
	d := newDesk()
	chunks := "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"he\"}}]}\n\n" +
		"data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"llo\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"
	for _, c := range []struct {
		name        string
		err         error
		status      int
		contentType string
		body        string
		want        outcome
		out         string // the body recorded or passed on (a part of it)
		refusal     string
	}{
		{"a response: recorded", nil, 200, "application/json", completion, outcomeRecord, completion, ""},
		{"a stream: assembled, recorded", nil, 200, "text/event-stream; charset=utf-8", chunks, outcomeRecord, `"content":"hello"`, ""},
		{"a refusal of the model: passed on", nil, 400, "application/json", `{"error":{"message":"too long"}}`, outcomePassOn, "too long", ""},
		{"a busy model: passed on", nil, 429, "", `slow down`, outcomePassOn, "slow down", ""},
		{"a refusal as a stream: passed on as it came", nil, 503, "text/event-stream", "data: x\n\n", outcomePassOn, "data: x", ""},
		{"no answer", errors.New("model server http://m: connection refused"), 0, "", "", outcomeRefuse, "", "model server http://m: connection refused"},
		{"a stream of no chunks", nil, 200, "text/event-stream", "data: [DONE]\n\n", outcomeRefuse, "", "model stream: stream held no chat completion chunk"},
		{"a stream of garbage", nil, 200, "text/event-stream", "data: {oops\n\n", outcomeRefuse, "", "model stream: stream chunk"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, out, ref := d.judge(c.err, c.status, c.contentType, []byte(c.body))
			if got != c.want || !strings.Contains(string(out), c.out) {
				t.Fatalf("judge: %v %s; want %v with %q", got, out, c.want, c.out)
			}
			if c.want == outcomeRefuse {
				refused(t, ref, 502, "upstream_error", refusedOther, c.refusal)
			} else if ref != nil {
				t.Fatalf("refused: %v", ref)
			}
		})
	}
}
