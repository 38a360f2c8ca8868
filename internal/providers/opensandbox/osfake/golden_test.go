package osfake_test

// The fake held to the golden bodies of internal/providers/opensandbox/testdata/golden
// (written from OpenSandbox's specifications, see its README): it is sent
// the golden requests as they are (ids, times and paths put in where they
// must be the fake's or the backend's), not through the provider, and its
// answers must have the golden answers' shape: the members the
// specification requires, with the same JSON types, and no member the
// specification does not name.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/textproto"
	"net/url"
	"strings"
	"testing"
	"time"

	"stasis/internal/golden"
	"stasis/internal/providers/local"
	"stasis/internal/providers/opensandbox/osfake"
	"stasis/internal/stasistest"
	"stasis/internal/testwait"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

const apiKey = "osk-test"

type fakeEnv struct {
	t   *testing.T
	g   *golden.Set
	url string
}

func newFake(t *testing.T) *fakeEnv {
	t.Helper()
	backend, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	f := osfake.New(osfake.Options{Backend: backend, APIKey: apiKey})
	srv := httptest.NewServer(f)
	t.Cleanup(func() {
		srv.Close()
		f.Close()
	})
	return &fakeEnv{t: t, g: golden.MustLoad(t, "../testdata/golden"), url: srv.URL}
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func (e *fakeEnv) do(method, u, contentType string, header map[string]string, body []byte) answer {
	e.t.Helper()
	req, err := http.NewRequest(method, u, bytes.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
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

// api calls the Lifecycle API with the key; a body is sent as JSON.
func (e *fakeEnv) api(method, path string, body []byte) answer {
	e.t.Helper()
	ct := ""
	if body != nil {
		ct = "application/json"
	}
	return e.do(method, e.url+"/v1"+path, ct, map[string]string{"OPEN-SANDBOX-API-KEY": apiKey}, body)
}

// status checks an answer's status, and that an error answer is the
// specification's ErrorResponse.
func (e *fakeEnv) status(what string, a answer, want int) {
	e.t.Helper()
	if a.status != want {
		e.t.Fatalf("%s: %d %s, want %d", what, a.status, a.body, want)
	}
	if want >= 400 {
		e.g.Response(e.t, what, "error.response.json", a.body)
	}
	if want == http.StatusNoContent && len(a.body) > 0 {
		e.t.Errorf("%s: 204 with a body %q", what, a.body)
	}
}

// with is a golden body with members set (JSON pointers, "~1" for "/").
func with(t *testing.T, g *golden.Set, name string, set map[string]any) []byte {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal(g.Bytes(t, name), &v); err != nil {
		t.Fatal(err)
	}
	for p, val := range set {
		segs := strings.Split(strings.TrimPrefix(p, "/"), "/")
		cur := v
		for _, s := range segs[:len(segs)-1] {
			cur = cur[strings.ReplaceAll(s, "~1", "/")].(map[string]any)
		}
		cur[strings.ReplaceAll(segs[len(segs)-1], "~1", "/")] = val
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func obj(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	return m
}

func state(t *testing.T, b []byte) string {
	t.Helper()
	st, _ := obj(t, b)["status"].(map[string]any)
	s, _ := st["state"].(string)
	return s
}

// waitState polls a sandbox (or a snapshot) until it is in a state.
func (e *fakeEnv) waitState(path, want string) []byte {
	e.t.Helper()
	var last []byte
	testwait.Until(e.t, path+" "+want, time.Minute, func() bool {
		a := e.api("GET", path, nil)
		last = a.body
		return a.status == http.StatusOK && state(e.t, a.body) == want
	})
	return last
}

// execd is a sandbox's execd, as its golden Endpoint answer says: the URL
// (without a scheme) and the headers.
type execd struct {
	url    string
	header map[string]string
}

// events reads execd's event stream (a JSON line and a blank line per
// event; "data:" lines are read too) into a JSON array.
func events(t *testing.T, body []byte) []byte {
	t.Helper()
	var evs [][]byte
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		line := bytes.TrimPrefix(sc.Bytes(), []byte("data: "))
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		evs = append(evs, append([]byte(nil), line...))
	}
	return append(append([]byte("["), bytes.Join(evs, []byte(","))...), ']')
}

type event struct {
	Type  string `json:"type"`
	Text  string `json:"text"`
	Error *struct {
		EValue string `json:"evalue"`
	} `json:"error"`
}

func decodeEvents(t *testing.T, b []byte) []event {
	t.Helper()
	var evs []event
	if err := json.Unmarshal(b, &evs); err != nil {
		t.Fatal(err)
	}
	return evs
}

// upload is execd's upload form: the metadata part (a file part, as execd
// reads it, of JSON) then the file part.
func upload(t *testing.T, meta, data []byte) ([]byte, string) {
	t.Helper()
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	h := textproto.MIMEHeader{}
	h.Set("Content-Disposition", `form-data; name="metadata"; filename="metadata"`)
	h.Set("Content-Type", "application/json")
	part, err := mw.CreatePart(h)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = part.Write(meta)
	part, err = mw.CreateFormFile("file", "file.txt")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = part.Write(data)
	if err := mw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes(), mw.FormDataContentType()
}

func TestGoldenFake(t *testing.T) {
	e := newFake(t)
	g := e.g

	// Create, from the golden request as it is.
	a := e.api("POST", "/sandboxes", g.Bytes(t, "sandboxes.create.request.json"))
	e.status("create", a, http.StatusAccepted)
	g.Response(t, "create", "sandboxes.create.response.json", a.body)
	id := obj(t, a.body)["id"].(string)
	if loc := a.header.Get("Location"); loc != "/v1/sandboxes/"+id {
		t.Errorf("Location %q", loc)
	}
	if st := state(t, a.body); st != "Pending" {
		t.Errorf("created in state %q, want Pending", st)
	}

	body := e.waitState("/sandboxes/"+id, "Running")
	g.Response(t, "get", "sandboxes.get.response.json", body)
	req, got := obj(t, g.Bytes(t, "sandboxes.create.request.json")), obj(t, body)
	if fmt.Sprint(got["metadata"]) != fmt.Sprint(req["metadata"]) || fmt.Sprint(got["entrypoint"]) != fmt.Sprint(req["entrypoint"]) || fmt.Sprint(got["image"]) != fmt.Sprint(req["image"]) {
		t.Errorf("the golden create's metadata, entrypoint and image: %s", body)
	}
	created, _ := time.Parse(time.RFC3339Nano, got["createdAt"].(string))
	expires, _ := time.Parse(time.RFC3339Nano, got["expiresAt"].(string))
	if d := expires.Sub(created); d < 3630*time.Second-time.Second || d > 3630*time.Second+time.Second {
		t.Errorf("the golden create's timeout of 3630 s: it expires %s after it was made", d)
	}

	q := url.Values{"page": {"1"}, "pageSize": {"100"}, "metadata": {"team=ml"}}
	a = e.api("GET", "/sandboxes?"+q.Encode(), nil)
	e.status("list", a, http.StatusOK)
	g.Response(t, "list", "sandboxes.list.response.json", a.body)
	if !strings.Contains(string(a.body), id) {
		t.Errorf("list: %s", a.body)
	}

	renew := time.Now().Add(2 * time.Hour).UTC().Truncate(time.Second).Format(time.RFC3339)
	a = e.api("POST", "/sandboxes/"+id+"/renew-expiration", with(t, g, "sandboxes.renew.request.json", map[string]any{"/expiresAt": renew}))
	e.status("renew", a, http.StatusOK)
	g.Response(t, "renew", "sandboxes.renew.response.json", a.body)
	if at, _ := time.Parse(time.RFC3339Nano, obj(t, a.body)["expiresAt"].(string)); !at.Equal(mustTime(t, renew)) {
		t.Errorf("renewed to %s", a.body)
	}

	a = e.api("PATCH", "/sandboxes/"+id+"/metadata", g.Bytes(t, "sandboxes.metadata.request.json"))
	e.status("patch metadata", a, http.StatusOK)
	g.Response(t, "patch metadata", "sandboxes.get.response.json", a.body)
	if md := obj(t, a.body)["metadata"].(map[string]any); md["stasis.internal/expiry-ms"] != "1893560645000" || md["team"] != "ml" {
		t.Errorf("the golden merge patch: %s", a.body)
	}

	a = e.api("GET", "/sandboxes/"+id+"/endpoints/44772", nil)
	e.status("endpoint", a, http.StatusOK)
	g.Response(t, "endpoint", "sandboxes.endpoint.response.json", a.body)
	ep := obj(t, a.body)
	x := execd{url: "http://" + ep["endpoint"].(string), header: map[string]string{}}
	for k, v := range ep["headers"].(map[string]any) {
		x.header[k] = v.(string)
	}
	if !strings.HasSuffix(x.url, "/sandboxes/"+id+"/port/44772") || x.header["X-EXECD-ACCESS-TOKEN"] == "" {
		t.Errorf("endpoint %s: the format the specification gives, and execd's access token", a.body)
	}

	t.Run("execd", func(t *testing.T) {
		if a := e.do("GET", x.url+"/ping", "", x.header, nil); a.status != http.StatusOK {
			t.Fatalf("ping: %d %s", a.status, a.body)
		}
		run := func(body []byte) answer {
			return e.do("POST", x.url+"/command", "application/json", map[string]string{"X-EXECD-ACCESS-TOKEN": x.header["X-EXECD-ACCESS-TOKEN"], "Accept": "text/event-stream"}, body)
		}
		a := run(g.Bytes(t, "command.request.json"))
		if a.status != http.StatusOK || !strings.HasPrefix(a.header.Get("Content-Type"), "text/event-stream") {
			t.Fatalf("command: %d %q %s", a.status, a.header.Get("Content-Type"), a.body)
		}
		evs := events(t, a.body)
		g.Response(t, "command's events", "command.events.json", evs)
		var out, errs []string
		decoded := decodeEvents(t, evs)
		for _, ev := range decoded {
			switch ev.Type {
			case "stdout":
				out = append(out, ev.Text)
			case "stderr":
				errs = append(errs, ev.Text)
			}
		}
		if decoded[0].Type != "init" || decoded[0].Text == "" || decoded[len(decoded)-1].Type != "execution_complete" ||
			strings.Join(out, "|") != "Hello, World!" || strings.Join(errs, "|") != "warning: disk almost full" {
			t.Errorf("the golden command's events: %s", evs)
		}
		a = run(g.Bytes(t, "command.mkdir.request.json"))
		if evs := decodeEvents(t, events(t, a.body)); a.status != http.StatusOK || evs[len(evs)-1].Type != "execution_complete" {
			t.Errorf("the golden mkdir: %d %s", a.status, a.body)
		}
		a = run(with(t, g, "command.request.json", map[string]any{"/command": "exit 7"}))
		evs = events(t, a.body)
		g.Response(t, "a failing command's events", "command.error.events.json", evs)
		if d := decodeEvents(t, evs); d[len(d)-1].Type != "error" || d[len(d)-1].Error == nil || d[len(d)-1].Error.EValue != "7" {
			t.Errorf("a command that exits 7: %s", evs)
		}

		// Upload the golden metadata (to a path the backend can write),
		// then download.
		form, ct := upload(t, with(t, g, "files.upload.metadata.json", map[string]any{"/path": "/tmp/file.txt"}), []byte("hello"))
		a = e.do("POST", x.url+"/files/upload", ct, x.header, form)
		if a.status != http.StatusOK {
			t.Fatalf("upload: %d %s", a.status, a.body)
		}
		a = e.do("GET", x.url+"/files/download?path=/tmp/file.txt", "", x.header, nil)
		if a.status != http.StatusOK || string(a.body) != "hello" {
			t.Fatalf("download: %d %q", a.status, a.body)
		}
		a = e.do("GET", x.url+"/files/download?path=/tmp/missing.txt", "", x.header, nil)
		if a.status != http.StatusNotFound {
			t.Fatalf("download of a missing file: %d %s", a.status, a.body)
		}
		g.Response(t, "download of a missing file", "files.notfound.response.json", a.body)
		if obj(t, a.body)["code"] != "FILE_NOT_FOUND" {
			t.Errorf("download of a missing file: %s", a.body)
		}
		a = run([]byte(`{"cwd": "/"}`))
		if a.status != http.StatusBadRequest {
			t.Fatalf("a command without command: %d %s", a.status, a.body)
		}
		g.Response(t, "a command without command", "execd.badrequest.response.json", a.body)
	})

	// Snapshots: the golden named and unnamed requests as they are.
	var snaps []string
	for _, name := range []string{"sandboxes.snapshots.request.json", "sandboxes.snapshots.unnamed.request.json"} {
		a = e.api("POST", "/sandboxes/"+id+"/snapshots", g.Bytes(t, name))
		e.status(name, a, http.StatusAccepted)
		g.Response(t, name, "sandboxes.snapshots.response.json", a.body)
		sid := obj(t, a.body)["id"].(string)
		snaps = append(snaps, sid)
		body := e.waitState("/snapshots/"+sid, "Ready")
		g.Response(t, "get snapshot", "snapshots.get.response.json", body)
		want, named := obj(t, g.Bytes(t, name))["name"]
		if got, has := obj(t, body)["name"]; has != named || got != want {
			t.Errorf("snapshot from %s: %s", name, body)
		}
	}

	// Fork: the golden restore with the snapshot's id.
	fork := with(t, g, "sandboxes.fork.request.json", map[string]any{"/snapshotId": snaps[0]})
	a = e.api("POST", "/sandboxes", fork)
	e.status("fork", a, http.StatusAccepted)
	g.Response(t, "fork", "sandboxes.create.response.json", a.body)
	forkID := obj(t, a.body)["id"].(string)
	body = e.waitState("/sandboxes/"+forkID, "Running")
	g.Response(t, "get the fork", "sandboxes.get.response.json", body)
	if got := obj(t, body); fmt.Sprint(got["metadata"]) != fmt.Sprint(obj(t, fork)["metadata"]) || got["snapshotId"] != snaps[0] {
		t.Errorf("the golden fork's metadata and snapshotId: %s", body)
	}

	// Pause and resume: no bodies.
	a = e.api("POST", "/sandboxes/"+id+"/pause", nil)
	e.status("pause", a, http.StatusAccepted)
	body = e.waitState("/sandboxes/"+id, "Paused")
	g.Response(t, "get paused", "sandboxes.get.paused.response.json", body)
	a = e.api("POST", "/sandboxes/"+id+"/resume", nil)
	e.status("resume", a, http.StatusAccepted)
	e.waitState("/sandboxes/"+id, "Running")

	for _, sid := range snaps {
		e.status("delete snapshot", e.api("DELETE", "/snapshots/"+sid, nil), http.StatusNoContent)
	}
	for _, sb := range []string{forkID, id} {
		e.status("delete", e.api("DELETE", "/sandboxes/"+sb, nil), http.StatusNoContent)
	}
	e.status("get after delete", e.api("GET", "/sandboxes/"+id, nil), http.StatusNotFound)
	e.status("get a deleted snapshot", e.api("GET", "/snapshots/"+snaps[0], nil), http.StatusNotFound)
}

func mustTime(t *testing.T, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestFakeRefusesWhatTheSpecificationRefuses: member names are the
// specification's exactly (Go's encoding/json would take them in any
// letter case; the reference server does not), and closed schemas take no
// other member.
func TestFakeRefusesWhatTheSpecificationRefuses(t *testing.T) {
	e := newFake(t)
	g := e.g
	a := e.api("POST", "/sandboxes", g.Bytes(t, "sandboxes.create.request.json"))
	e.status("create", a, http.StatusAccepted)
	id := obj(t, a.body)["id"].(string)
	e.waitState("/sandboxes/"+id, "Running")
	for _, c := range []struct {
		what, path string
		body       []byte
	}{
		{"create with Metadata, not metadata", "/sandboxes", bytes.Replace(g.Bytes(t, "sandboxes.create.request.json"), []byte(`"metadata"`), []byte(`"Metadata"`), 1)},
		{"create with resourcelimits, not resourceLimits", "/sandboxes", bytes.Replace(g.Bytes(t, "sandboxes.create.request.json"), []byte(`"resourceLimits"`), []byte(`"resourcelimits"`), 1)},
		{"create with image.URI, not image.uri", "/sandboxes", bytes.Replace(g.Bytes(t, "sandboxes.create.request.json"), []byte(`"uri"`), []byte(`"URI"`), 1)},
		{"renew with expiresat, not expiresAt", "/sandboxes/" + id + "/renew-expiration", []byte(`{"expiresat": "` + time.Now().Add(2*time.Hour).UTC().Format(time.RFC3339) + `"}`)},
		{"snapshot with Name, not name", "/sandboxes/" + id + "/snapshots", []byte(`{"Name": "x"}`)},
		{"snapshot with another member", "/sandboxes/" + id + "/snapshots", []byte(`{"name": "x", "label": "y"}`)},
	} {
		a := e.api("POST", c.path, c.body)
		if a.status != http.StatusBadRequest {
			t.Errorf("%s: %d %s, want 400", c.what, a.status, a.body)
			continue
		}
		g.Response(t, c.what, "error.response.json", a.body)
	}
	a = e.api("GET", "/sandboxes/"+id+"/endpoints/44772", nil)
	ep := obj(t, a.body)
	token := ep["headers"].(map[string]any)["X-EXECD-ACCESS-TOKEN"].(string)
	a = e.do("POST", "http://"+ep["endpoint"].(string)+"/command", "application/json", map[string]string{"X-EXECD-ACCESS-TOKEN": token},
		bytes.Replace(g.Bytes(t, "command.request.json"), []byte(`"command"`), []byte(`"Command"`), 1))
	if a.status != http.StatusBadRequest {
		t.Errorf("a command with Command, not command: %d %s, want 400", a.status, a.body)
	} else {
		g.Response(t, "a command with Command", "execd.badrequest.response.json", a.body)
	}
	e.status("delete", e.api("DELETE", "/sandboxes/"+id, nil), http.StatusNoContent)
}

// TestFakeAnswersAnEntrypointForAPool: a pool's sandbox is made without an
// entrypoint; the answer still has one (the specification requires it in
// every Sandbox, as an array).
func TestFakeAnswersAnEntrypointForAPool(t *testing.T) {
	e := newFake(t)
	a := e.api("POST", "/sandboxes", []byte(`{"extensions": {"poolRef": "pool-a"}, "timeout": 3630}`))
	e.status("create from a pool", a, http.StatusAccepted)
	e.g.Response(t, "create from a pool", "sandboxes.create.response.json", a.body)
	id := obj(t, a.body)["id"].(string)
	e.g.Response(t, "get from a pool", "sandboxes.get.response.json", e.api("GET", "/sandboxes/"+id, nil).body)
	e.status("delete", e.api("DELETE", "/sandboxes/"+id, nil), http.StatusNoContent)
}
