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
	"testing"

	"stasis/internal/control/server"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/stasistest"
)

// bodyRoutes are the operations that take a JSON body, on a server with
// one committed checkpoint of no episodes (ck-empty) and none called
// ck-none.
var bodyRoutes = []string{
	"/v1/episodes",
	"/v1/checkpoints",
	"/v1/checkpoints/ck-none/restore",
	"/v1/checkpoints/ck-none/branch",
	"/v1/checkpoints/ck-empty/restore",
	"/v1/checkpoints/ck-empty/branch",
}

// FuzzAPIBodies sends any body to each operation that takes one, on a
// real server that has no task (so no episode can start): every answer
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
			`{"limits":{"pids":-1}}`, `{"image":"oci:"}`, `{"id":"` + string(bytes.Repeat([]byte("a"), 300)) + `"}`, "\xff\xfe",
		} {
			f.Add(uint8(i), []byte(b))
		}
	}
	state, err := os.MkdirTemp("", "stasis-fuzz-api-")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = os.RemoveAll(state) })
	srv, err := server.New(context.Background(), server.Options{Config: system.Config{
		State: filepath.Join(state, "state"), Tasks: []*task.Task{}, Concurrency: 4,
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
	if code, b := send("POST", "/v1/checkpoints", []byte(`{"id":"ck-empty"}`)); code != http.StatusCreated {
		f.Fatalf("make ck-empty: %d %s", code, b)
	}
	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		path := bodyRoutes[int(route)%len(bodyRoutes)]
		code, b := send("POST", path, body)
		switch {
		case code >= 500 || code == 0:
			t.Fatalf("POST %s %q: %d %s", path, body, code, b)
		case code >= 400:
			var e struct {
				Error struct{ Type, Message string } `json:"error"`
			}
			if err := json.Unmarshal(b, &e); err != nil || e.Error.Type == "" || e.Error.Message == "" {
				t.Fatalf("POST %s %q: %d with an answer that is not a JSON error: %s", path, body, code, b)
			}
		case path == "/v1/checkpoints" && code == http.StatusCreated:
			var ck server.CheckpointResponse
			if err := json.Unmarshal(b, &ck); err != nil || ck.Checkpoint == "" || ck.Checkpoint == "ck-empty" {
				t.Fatalf("POST %s %q: %d %s", path, body, code, b)
			}
			if code, b := send("DELETE", "/v1/checkpoints/"+ck.Checkpoint, nil); code != http.StatusOK {
				t.Fatalf("delete the checkpoint %s made: %d %s", ck.Checkpoint, code, b)
			}
		case path == "/v1/checkpoints/ck-empty/restore" && code == http.StatusOK:
		default:
			t.Fatalf("POST %s %q: %d %s: no success was possible", path, body, code, b)
		}
		var eps struct {
			Episodes []json.RawMessage `json:"episodes"`
		}
		if code, b := send("GET", "/v1/episodes", nil); code != http.StatusOK || json.Unmarshal(b, &eps) != nil || len(eps.Episodes) != 0 {
			t.Fatalf("after POST %s %q: episodes %d %s", path, body, code, b)
		}
		var cks struct {
			Checkpoints []struct {
				ID string `json:"id"`
			} `json:"checkpoints"`
		}
		if code, b := send("GET", "/v1/checkpoints", nil); code != http.StatusOK || json.Unmarshal(b, &cks) != nil || len(cks.Checkpoints) != 1 || cks.Checkpoints[0].ID != "ck-empty" {
			t.Fatalf("after POST %s %q: checkpoints %d %s", path, body, code, b)
		}
	})
}
