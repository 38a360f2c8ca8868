package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"stasis/internal/control/server"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/stasistest"
)

// bodyRoutes are the operations that take a body ("METHOD /path"): every
// route of the server's but its GETs (FuzzAPIBodies checks that none is
// missing), on a server with one committed checkpoint of no episodes
// (ck-empty) and none called ck-none, and no episode.
var bodyRoutes = []string{
	"POST /v1/episodes",
	"POST /v1/checkpoints",
	"POST /v1/checkpoints/ck-none/restore",
	"POST /v1/checkpoints/ck-none/branch",
	"POST /v1/checkpoints/ck-empty/restore",
	"POST /v1/checkpoints/ck-empty/branch",
	"POST /v1/episodes/ep-none/verify",
	"POST /v1/episodes/ep-none/retire",
	"DELETE /v1/checkpoints/ck-none",
}

// FuzzAPIBodies sends any body to each operation that takes one, on a
// real server with one task whose image is not there (so a body gets
// through every check to the sandbox's creation, but no episode can
// start): every answer
// is a JSON error with a type and a message, never a 500, or a success
// that changed only what it says (a checkpoint made, which is deleted
// again; a restore of the empty checkpoint). Nothing else changes: no
// episode appears, and the checkpoints are as they were.
func FuzzAPIBodies(f *testing.F) {
	for i := range bodyRoutes {
		for _, b := range []string{
			``, `{}`, `null`, `[]`, `"x"`, `{"id":"ep-1","task":"sh-renext-spaces","harness":"mini"}`,
			`{"id":"../../etc","task":"x"}`, `{"id":"ck-2"}`, `{"id":"ck-2","stragglers":"nope"}`, `{"episodes":[]}`,
			`{"episodes":["ep-x"]}`, `{"episode":"ep-x","copies":2,"ids":["a","b"]}`, `{"episode":"ep-x","copies":-1}`,
			`{"episode":"ep-x","copies":100000}`, `{"id":"x"}{"id":"y"}`, `{"id":"x","shiny":1}`, `{"deadline_s":1e309}`,
			`{"limits":{"pids":-1}}`, `{"image":"oci:"}`,
			// Past the task's lookup, each of the other checks.
			`{"task":"sh-renext-spaces","harness":"opencode"}`, `{"task":"sh-renext-spaces","harness":"mini","provider":"e2b"}`,
			`{"task":"sh-renext-spaces","harness":"mini","pause_mode":"hold"}`, `{"task":"sh-renext-spaces","harness":"mini","pause_mode":"x"}`,
			`{"task":"sh-renext-spaces","harness":"mini","deadline_s":0}`, `{"task":"sh-renext-spaces","harness":"mini","deadline_s":1e9}`,
			`{"task":"sh-renext-spaces","harness":"mini","limits":{"pids":-1}}`, `{"task":"sh-renext-spaces","harness":"mini","limits":{"memory_bytes":1}}`,
			`{"task":"sh-renext-spaces","harness":"mini","image":"oci:/nonexistent:v1"}`, `{"task":"sh-renext-spaces","harness":"mini","image":"sha256:` + strings.Repeat("0", 64) + `"}`,
			`{"task":"sh-renext-spaces","harness":"mini","image":"docker-archive:/nonexistent.tar"}`, `{"task":"sh-renext-spaces","harness":"mini","image":" x"}`, `{"id":"` + string(bytes.Repeat([]byte("a"), 300)) + `"}`, "\xff\xfe",
		} {
			f.Add(uint8(i), []byte(b))
		}
	}
	state, err := os.MkdirTemp("", "stasis-fuzz-api-")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = os.RemoveAll(state) })
	// One task, so a body gets past the task's lookup to the rest of the
	// checks and to the coordinator; its image is a layout that is not
	// there, so no episode can start.
	builtin, err := task.Builtin()
	if err != nil {
		f.Fatal(err)
	}
	tk, err := task.Lookup(builtin, "sh-renext-spaces")
	if err != nil {
		f.Fatal(err)
	}
	fuzzTask := *tk
	fuzzTask.Image = "oci:" + filepath.Join(state, "no-layout")
	srv, err := server.New(context.Background(), server.Options{Config: system.Config{
		State: filepath.Join(state, "state"), Tasks: []*task.Task{&fuzzTask}, Concurrency: 4,
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, Binary: stasistest.Exe(), BinaryEnv: binaryEnv,
	}})
	if err != nil {
		f.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	f.Cleanup(func() {
		ts.Close()
		if err := srv.Close(); err != nil {
			f.Error(err)
		}
	})
	// send answers 0 and the error when the request could not be made.
	send := func(method, path string, body []byte) (int, []byte) {
		q, err := http.NewRequest(method, ts.URL+path, bytes.NewReader(body))
		if err != nil {
			return 0, []byte(err.Error())
		}
		q.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(q)
		if err != nil {
			return 0, []byte(err.Error())
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	for _, r := range srv.Routes() {
		method, pattern, _ := strings.Cut(r, " ")
		if method == http.MethodGet {
			continue
		}
		re := regexp.MustCompile("^" + method + " " + regexp.MustCompile(`\\\{[a-z]+\\\}`).ReplaceAllString(regexp.QuoteMeta(pattern), "[^/]+") + "$")
		if !slices.ContainsFunc(bodyRoutes, re.MatchString) {
			f.Fatalf("the server's route %s is not in bodyRoutes: add it", r)
		}
	}
	if code, b := send("POST", "/v1/checkpoints", []byte(`{"id":"ck-empty"}`)); code != http.StatusCreated {
		f.Fatalf("make ck-empty: %d %s", code, b)
	}
	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		method, path, _ := strings.Cut(bodyRoutes[int(route)%len(bodyRoutes)], " ")
		// A registry's image would be pulled over the network.
		var start server.StartRequest
		if path == "/v1/episodes" && json.Unmarshal(body, &start) == nil && strings.HasPrefix(start.Image, "docker://") {
			t.Skip("a registry image: no network here")
		}
		code, b := send(method, path, body)
		switch {
		case code >= 500 || code == 0:
			t.Fatalf("%s %s %q: %d %s", method, path, body, code, b)
		case code >= 400:
			var e struct {
				Error struct{ Type, Message string } `json:"error"`
			}
			if err := json.Unmarshal(b, &e); err != nil || e.Error.Type == "" || e.Error.Message == "" {
				t.Fatalf("%s %s %q: %d with an answer that is not a JSON error: %s", method, path, body, code, b)
			}
		case path == "/v1/checkpoints" && code == http.StatusCreated:
			var ck server.CheckpointResponse
			if err := json.Unmarshal(b, &ck); err != nil || ck.Checkpoint == "" || ck.Checkpoint == "ck-empty" {
				t.Fatalf("%s %s %q: %d %s", method, path, body, code, b)
			}
			if code, b := send("DELETE", "/v1/checkpoints/"+ck.Checkpoint, nil); code != http.StatusOK {
				t.Fatalf("delete the checkpoint %s made: %d %s", ck.Checkpoint, code, b)
			}
		case path == "/v1/checkpoints/ck-empty/restore" && code == http.StatusOK:
		default:
			t.Fatalf("%s %s %q: %d %s: no success was possible", method, path, body, code, b)
		}
		var eps struct {
			Episodes []json.RawMessage `json:"episodes"`
		}
		if code, b := send("GET", "/v1/episodes", nil); code != http.StatusOK || json.Unmarshal(b, &eps) != nil || len(eps.Episodes) != 0 {
			t.Fatalf("after %s %s %q: episodes %d %s", method, path, body, code, b)
		}
		var cks struct {
			Checkpoints []struct {
				ID string `json:"id"`
			} `json:"checkpoints"`
		}
		if code, b := send("GET", "/v1/checkpoints", nil); code != http.StatusOK || json.Unmarshal(b, &cks) != nil || len(cks.Checkpoints) != 1 || cks.Checkpoints[0].ID != "ck-empty" {
			t.Fatalf("after %s %s %q: checkpoints %d %s", method, path, body, code, b)
		}
	})
}
