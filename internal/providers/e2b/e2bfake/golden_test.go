package e2bfake_test

// The fake held to the golden bodies of internal/providers/e2b/testdata/golden
// (written from E2B's specifications, see its README): it is sent the
// golden requests as they are (ids and PIDs put in where they must be the
// fake's own), not through the provider, and its answers must have the
// golden answers' shape: the members the specification requires, with the
// same JSON types, and no member the specification does not name.

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"stasis/internal/golden"
	"stasis/internal/providers/e2b/e2bfake"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

type fakeEnv struct {
	t   *testing.T
	g   *golden.Set
	f   *e2bfake.Server
	url string
}

func newFake(t *testing.T) *fakeEnv {
	t.Helper()
	lp, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	f := e2bfake.New(lp, e2bfake.Options{})
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close) // after the fake has ended every process
	t.Cleanup(func() { _ = f.Close() })
	return &fakeEnv{t: t, g: golden.MustLoad(t, "../testdata/golden"), f: f, url: srv.URL}
}

// answer is an HTTP answer.
type answer struct {
	status int
	header http.Header
	body   []byte
}

func (e *fakeEnv) send(req *http.Request) answer {
	e.t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, b}
}

// api makes a REST call with the API key; a body is sent as JSON.
func (e *fakeEnv) api(method, path string, body []byte) answer {
	e.t.Helper()
	req, err := http.NewRequest(method, e.url+path, bytes.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	req.Header.Set("X-API-Key", e.f.APIKey())
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return e.send(req)
}

// envdRequest is a request to a sandbox's envd, routed and authenticated
// as envd.yaml and the sandbox proxy say.
func (e *fakeEnv) envdRequest(sb sandboxRef, method, path, contentType string, body []byte) *http.Request {
	e.t.Helper()
	req, err := http.NewRequest(method, e.url+path, bytes.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	req.Header.Set("E2b-Sandbox-Id", sb.id)
	req.Header.Set("E2b-Sandbox-Port", "49983")
	req.Header.Set("X-Access-Token", sb.token)
	req.SetBasicAuth("root", "")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	return req
}

func (e *fakeEnv) envd(sb sandboxRef, method, path, contentType string, body []byte) answer {
	e.t.Helper()
	return e.send(e.envdRequest(sb, method, path, contentType, body))
}

type sandboxRef struct{ id, token string }

// status checks an answer's status, and that an error answer is the
// specification's Error.
func (e *fakeEnv) status(what string, a answer, want int) {
	e.t.Helper()
	if a.status != want {
		e.t.Fatalf("%s: %d %s, want %d", what, a.status, a.body, want)
	}
	if want >= 400 {
		e.g.Response(e.t, what, "error.notfound.response.json", a.body)
	}
	if want == http.StatusNoContent && len(a.body) > 0 {
		e.t.Errorf("%s: 204 with a body %q", what, a.body)
	}
}

// with is a golden body with members set (JSON pointers, no escapes).
func with(t *testing.T, g *golden.Set, name string, set map[string]any) []byte {
	t.Helper()
	var v any
	if err := json.Unmarshal(g.Bytes(t, name), &v); err != nil {
		t.Fatal(err)
	}
	for p, val := range set {
		segs := strings.Split(strings.TrimPrefix(p, "/"), "/")
		cur := v
		for i, s := range segs {
			last := i == len(segs)-1
			switch c := cur.(type) {
			case map[string]any:
				if last {
					c[s] = val
				} else {
					cur = c[s]
				}
			case []any:
				n, _ := strconv.Atoi(s)
				if last {
					c[n] = val
				} else {
					cur = c[n]
				}
			}
		}
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// obj decodes a JSON object.
func obj(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	return m
}

func envelope(msg []byte) []byte {
	out := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(out[1:], uint32(len(msg)))
	return append(out, msg...)
}

// stream is an open Start call's answer.
type stream struct {
	t    *testing.T
	body io.ReadCloser
}

// next reads a message: its JSON and whether it ends the stream.
func (s *stream) next() ([]byte, bool) {
	s.t.Helper()
	var hdr [5]byte
	if _, err := io.ReadFull(s.body, hdr[:]); err != nil {
		s.t.Fatalf("the stream ended without its end-of-stream message: %v", err)
	}
	if hdr[0]&^0x02 != 0 {
		s.t.Fatalf("envelope flags %#x", hdr[0])
	}
	msg := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
	if _, err := io.ReadFull(s.body, msg); err != nil {
		s.t.Fatal(err)
	}
	return msg, hdr[0]&0x02 != 0
}

// rest reads the messages up to the end of the stream: the messages as a
// JSON array, and the end-of-stream message.
func (s *stream) rest(before ...[]byte) ([]byte, []byte) {
	s.t.Helper()
	msgs := append([][]byte(nil), before...)
	for {
		m, end := s.next()
		if end {
			if _, err := s.body.Read(make([]byte, 1)); err != io.EOF {
				s.t.Errorf("the stream goes on after its end-of-stream message: %v", err)
			}
			return append(append([]byte("["), bytes.Join(msgs, []byte(","))...), ']'), m
		}
		msgs = append(msgs, m)
	}
}

// start calls Start with a body and returns the open stream.
func (e *fakeEnv) start(sb sandboxRef, body []byte) *stream {
	e.t.Helper()
	resp, err := http.DefaultClient.Do(e.envdRequest(sb, "POST", "/process.Process/Start", "application/connect+json", envelope(body)))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/connect+json" {
		b, _ := io.ReadAll(resp.Body)
		e.t.Fatalf("Start: %d %q %s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	return &stream{t: e.t, body: resp.Body}
}

func pidOf(t *testing.T, msg []byte) float64 {
	t.Helper()
	ev, _ := obj(t, msg)["event"].(map[string]any)
	start, _ := ev["start"].(map[string]any)
	pid, ok := start["pid"].(float64)
	if !ok || pid <= 0 {
		t.Fatalf("the first message is not a start event with a pid: %s", msg)
	}
	return pid
}

func TestGoldenFake(t *testing.T) {
	e := newFake(t)
	g := e.g

	// Create, from the golden request as it is.
	a := e.api("POST", "/sandboxes", g.Bytes(t, "sandboxes.create.request.json"))
	e.status("create", a, http.StatusCreated)
	g.Response(t, "create", "sandboxes.create.response.json", a.body)
	created := obj(t, a.body)
	sb := sandboxRef{id: created["sandboxID"].(string), token: created["envdAccessToken"].(string)}

	a = e.api("GET", "/sandboxes/"+sb.id, nil)
	e.status("get", a, http.StatusOK)
	g.Response(t, "get", "sandboxes.get.response.json", a.body)
	detail := obj(t, a.body)
	wantMeta := obj(t, g.Bytes(t, "sandboxes.create.request.json"))["metadata"]
	if fmt.Sprint(detail["metadata"]) != fmt.Sprint(wantMeta) || detail["state"] != "running" || detail["envdAccessToken"] != sb.token {
		t.Errorf("the golden create's metadata, state and token: %s", a.body)
	}
	started, _ := time.Parse(time.RFC3339Nano, detail["startedAt"].(string))
	ends, _ := time.Parse(time.RFC3339Nano, detail["endAt"].(string))
	if d := ends.Sub(started); d < time.Hour-time.Second || d > time.Hour+time.Second {
		t.Errorf("the golden create's timeout of 3600 s: it ends %s after it started", d)
	}

	q := url.Values{"metadata": {"stasis.provider=e2b"}, "state": {"running,paused"}, "limit": {"100"}}
	a = e.api("GET", "/v2/sandboxes?"+q.Encode(), nil)
	e.status("list", a, http.StatusOK)
	g.Response(t, "list", "sandboxes.list.response.json", a.body)
	if !strings.Contains(string(a.body), sb.id) || strings.Contains(string(a.body), "envdAccessToken") {
		t.Errorf("list: %s (ListedSandbox has no envdAccessToken)", a.body)
	}

	t0 := time.Now()
	a = e.api("POST", "/sandboxes/"+sb.id+"/timeout", g.Bytes(t, "sandboxes.timeout.request.json"))
	e.status("timeout", a, http.StatusNoContent)
	if end, ok := e.f.EndAt(sb.id); !ok || end.Before(t0.Add(2*time.Hour-time.Second)) || end.After(time.Now().Add(2*time.Hour+time.Second)) {
		t.Errorf("the golden timeout of 7200 s: ends at %s", end)
	}

	t.Run("files", func(t *testing.T) {
		const uploaded = "files.upload.response.json"
		const path = "/work/hello.txt" // the golden example's /home is read-only in the backend's sandboxes
		a := e.envd(sb, "POST", "/files?"+url.Values{"path": {path}, "username": {"root"}}.Encode(), "application/octet-stream", []byte("hello"))
		if a.status != http.StatusOK {
			t.Fatalf("upload: %d %s", a.status, a.body)
		}
		g.Response(t, "upload", uploaded, a.body)
		if err := golden.Match(a.body, []byte(`[{"path": "/work/hello.txt", "name": "hello.txt", "type": "file"}]`), nil); err != nil {
			t.Errorf("the upload's answer: %v", err)
		}
		a = e.envd(sb, "GET", "/files?"+url.Values{"path": {path}, "username": {"root"}}.Encode(), "", nil)
		if a.status != http.StatusOK || string(a.body) != "hello" {
			t.Fatalf("download: %d %q", a.status, a.body)
		}
		a = e.envd(sb, "GET", "/files?"+url.Values{"path": {"/home/user/missing.txt"}, "username": {"root"}}.Encode(), "", nil)
		if a.status != http.StatusNotFound {
			t.Fatalf("download of a missing file: %d %s", a.status, a.body)
		}
		g.Response(t, "download of a missing file", "files.notfound.response.json", a.body)
	})

	t.Run("process", func(t *testing.T) {
		// The golden Start, as it is: its stream is the golden one but
		// for the PID.
		s := e.start(sb, g.Bytes(t, "process.start.request.json"))
		msgs, end := s.rest()
		g.Response(t, "mkdir's stream", "process.start.ok.stream.json", msgs)
		if err := golden.Match(msgs, g.Bytes(t, "process.start.ok.stream.json"), map[string]string{"/0/event/start/pid": golden.AnyInteger}); err != nil {
			t.Errorf("mkdir's stream against the golden one: %v", err)
		}
		g.Response(t, "mkdir's end", "process.end.json", end)
		if err := golden.Match(end, g.Bytes(t, "process.end.json"), nil); err != nil {
			t.Errorf("mkdir's end of stream: %v", err)
		}

		// Stdin: the golden SendInput and CloseStdin, to the PID the
		// fake gave.
		s = e.start(sb, with(t, g, "process.start.request.json", map[string]any{"/process/args": []string{"-p", "--", "/work/sub"}}))
		s.rest()
		s = e.start(sb, g.Bytes(t, "process.start.stdin.request.json"))
		first, _ := s.next()
		pid := pidOf(t, first)
		for _, c := range []struct{ method, golden string }{{"SendInput", "process.sendinput.request.json"}, {"CloseStdin", "process.closestdin.request.json"}} {
			a := e.envd(sb, "POST", "/process.Process/"+c.method, "application/json", with(t, g, c.golden, map[string]any{"/process/pid": pid}))
			if a.status != http.StatusOK {
				t.Fatalf("%s: %d %s", c.method, a.status, a.body)
			}
			g.Response(t, c.method, "process.unary.response.json", a.body)
		}
		msgs, end = s.rest(first)
		g.Response(t, "the stdin command's stream", "process.start.stdin.stream.json", msgs)
		g.Response(t, "the stdin command's end", "process.end.json", end)
		var evs []struct {
			Event struct {
				Data map[string]string
				End  map[string]any
			}
		}
		if err := json.Unmarshal(msgs, &evs); err != nil {
			t.Fatal(err)
		}
		var out, errs []byte
		for _, ev := range evs {
			for k, v := range ev.Event.Data {
				b, err := base64.StdEncoding.DecodeString(v)
				if err != nil {
					t.Fatalf("data %s: %v", k, err)
				}
				if k == "stdout" {
					out = append(out, b...)
				} else {
					errs = append(errs, b...)
				}
			}
		}
		last := evs[len(evs)-1].Event.End
		if string(out) != "input" || string(errs) != "warn\n" || fmt.Sprint(last) != fmt.Sprint(obj(t, []byte(`{"exitCode":7,"exited":true,"status":"exit status 7"}`))) {
			t.Errorf("the golden stdin command: stdout %q, stderr %q, end %v", out, errs, last)
		}

		// SendSignal, golden, to a sleeping process: its stream is the
		// golden killed one.
		s = e.start(sb, g.Bytes(t, "process.start.sleep.request.json"))
		first, _ = s.next()
		a := e.envd(sb, "POST", "/process.Process/SendSignal", "application/json", with(t, g, "process.sendsignal.request.json", map[string]any{"/process/pid": pidOf(t, first)}))
		if a.status != http.StatusOK {
			t.Fatalf("SendSignal: %d %s", a.status, a.body)
		}
		g.Response(t, "SendSignal", "process.unary.response.json", a.body)
		msgs, end = s.rest(first)
		if err := golden.Match(msgs, g.Bytes(t, "process.start.killed.stream.json"), map[string]string{"/0/event/start/pid": golden.AnyInteger}); err != nil {
			t.Errorf("the killed process's stream against the golden one: %v", err)
		}
		g.Response(t, "the killed process's end", "process.end.json", end)

		// Errors: a unary call for no such process, a stream that fails.
		a = e.envd(sb, "POST", "/process.Process/SendInput", "application/json", with(t, g, "process.sendinput.request.json", map[string]any{"/process/pid": 999999}))
		if a.status != http.StatusNotFound {
			t.Fatalf("SendInput to no process: %d %s", a.status, a.body)
		}
		g.Response(t, "SendInput to no process", "process.unary.error.json", a.body)
		s = e.start(sb, with(t, g, "process.start.sleep.request.json", map[string]any{"/process/cmd": ""}))
		msgs, end = s.rest()
		if string(msgs) != "[]" {
			t.Errorf("a Start without a command: messages %s", msgs)
		}
		g.Response(t, "a Start without a command", "process.end.error.json", end)
		if e, _ := obj(t, end)["error"].(map[string]any); e == nil || e["code"] != "invalid_argument" {
			t.Errorf("a Start without a command: %s", end)
		}
	})

	// Snapshot (the golden, unnamed), list, fork from it.
	a = e.api("POST", "/sandboxes/"+sb.id+"/snapshots", g.Bytes(t, "sandboxes.snapshots.request.json"))
	e.status("snapshot", a, http.StatusCreated)
	g.Response(t, "snapshot", "sandboxes.snapshots.response.json", a.body)
	snapID := obj(t, a.body)["snapshotID"].(string)
	a = e.api("GET", "/snapshots?"+url.Values{"name": {snapID}, "limit": {"100"}}.Encode(), nil)
	e.status("snapshots", a, http.StatusOK)
	g.Response(t, "snapshots", "snapshots.list.response.json", a.body)
	if !strings.Contains(string(a.body), snapID) {
		t.Errorf("snapshots: %s", a.body)
	}
	fork := with(t, g, "sandboxes.fork.request.json", map[string]any{"/templateID": snapID})
	a = e.api("POST", "/sandboxes", fork)
	e.status("fork", a, http.StatusCreated)
	g.Response(t, "fork", "sandboxes.create.response.json", a.body)
	forkID := obj(t, a.body)["sandboxID"].(string)
	a = e.api("GET", "/sandboxes/"+forkID, nil)
	if fmt.Sprint(obj(t, a.body)["metadata"]) != fmt.Sprint(obj(t, fork)["metadata"]) || obj(t, a.body)["templateID"] != snapID {
		t.Errorf("the golden fork's metadata and template: %s", a.body)
	}
	e.status("delete the fork", e.api("DELETE", "/sandboxes/"+forkID, nil), http.StatusNoContent)
	e.status("delete the snapshot", e.api("DELETE", "/templates/"+snapID, nil), http.StatusNoContent)

	// Pause (golden) and resume (golden connect).
	e.status("pause", e.api("POST", "/sandboxes/"+sb.id+"/pause", g.Bytes(t, "sandboxes.pause.request.json")), http.StatusNoContent)
	a = e.api("GET", "/sandboxes/"+sb.id, nil)
	g.Response(t, "get paused", "sandboxes.get.response.json", a.body)
	if obj(t, a.body)["state"] != "paused" {
		t.Errorf("after pause: %s", a.body)
	}
	a = e.api("POST", "/sandboxes/"+sb.id+"/connect", g.Bytes(t, "sandboxes.connect.request.json"))
	e.status("connect", a, http.StatusCreated)
	g.Response(t, "connect", "sandboxes.connect.response.json", a.body)

	e.status("delete", e.api("DELETE", "/sandboxes/"+sb.id, nil), http.StatusNoContent)
	e.status("get after delete", e.api("GET", "/sandboxes/"+sb.id, nil), http.StatusNotFound)
}

// TestFakeRefusesWhatTheSpecificationRefuses: bodies that break the
// schemas (a required member or body missing, a value out of range, a
// member named in the wrong letter case, which Go's encoding/json would
// take) get 400 with an Error, as E2B's request validation answers; a
// Connect call with another content type gets 415.
func TestFakeRefusesWhatTheSpecificationRefuses(t *testing.T) {
	e := newFake(t)
	g := e.g
	a := e.api("POST", "/sandboxes", g.Bytes(t, "sandboxes.create.request.json"))
	e.status("create", a, http.StatusCreated)
	created := obj(t, a.body)
	sb := sandboxRef{id: created["sandboxID"].(string), token: created["envdAccessToken"].(string)}
	for _, c := range []struct {
		what, path string
		body       []byte
	}{
		{"create without templateID", "/sandboxes", []byte(`{"timeout": 60}`)},
		{"create with templateId, not templateID", "/sandboxes", bytes.Replace(g.Bytes(t, "sandboxes.create.request.json"), []byte(`"templateID"`), []byte(`"templateId"`), 1)},
		{"pause with Memory, not memory", "/sandboxes/" + sb.id + "/pause", []byte(`{"Memory": true}`)},
		{"create with a negative timeout", "/sandboxes", with(t, g, "sandboxes.create.request.json", map[string]any{"/timeout": -1})},
		{"create with a timeout that is no number", "/sandboxes", with(t, g, "sandboxes.create.request.json", map[string]any{"/timeout": "60"})},
		{"timeout without timeout", "/sandboxes/" + sb.id + "/timeout", []byte(`{}`)},
		{"timeout without a body", "/sandboxes/" + sb.id + "/timeout", nil},
		{"connect without timeout", "/sandboxes/" + sb.id + "/connect", []byte(`{}`)},
		{"snapshot without a body", "/sandboxes/" + sb.id + "/snapshots", nil},
	} {
		a := e.api("POST", c.path, c.body)
		if a.status != http.StatusBadRequest {
			t.Errorf("%s: %d %s, want 400", c.what, a.status, a.body)
			continue
		}
		g.Response(t, c.what, "error.notfound.response.json", a.body)
	}
	a = e.envd(sb, "POST", "/process.Process/Start", "application/json", envelope(g.Bytes(t, "process.start.request.json")))
	if a.status != http.StatusUnsupportedMediaType {
		t.Errorf("Start as application/json: %d %s, want 415", a.status, a.body)
	}
	a = e.envd(sb, "POST", "/process.Process/SendInput", "text/plain", g.Bytes(t, "process.sendinput.request.json"))
	if a.status != http.StatusUnsupportedMediaType {
		t.Errorf("SendInput as text/plain: %d %s, want 415", a.status, a.body)
	}
	a = e.envd(sb, "POST", "/process.Process/SendSignal", "application/json", bytes.Replace(g.Bytes(t, "process.sendsignal.request.json"), []byte(`"pid"`), []byte(`"PID"`), 1))
	if a.status != http.StatusBadRequest || !strings.Contains(string(a.body), "invalid_argument") {
		t.Errorf("SendSignal with PID, not pid: %d %s, want 400 invalid_argument", a.status, a.body)
	}
	e.status("delete", e.api("DELETE", "/sandboxes/"+sb.id, nil), http.StatusNoContent)
}
