package server_test

import (
	"encoding/json"
	"reflect"
	"sort"
	"strings"
	"testing"

	"stasis/internal/control/coordinator"
	"stasis/internal/control/openapi"
	"stasis/internal/control/server"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// jsonFields lists the JSON names of t's fields as encoding/json writes
// them: embedded structs flattened, "-" left out.
func jsonFields(t reflect.Type) []string {
	var out []string
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("json")
		name, _, _ := strings.Cut(tag, ",")
		if name == "-" {
			continue
		}
		if f.Anonymous && name == "" {
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			out = append(out, jsonFields(ft)...)
			continue
		}
		if name == "" {
			name = f.Name
		}
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// TestOpenAPISchemasMatchTypes: each schema of the server's document has
// exactly the fields of the Go type the handlers encode or decode, so a
// field added to a type (or renamed) without the document fails here, and
// the Python client's conformance test, which reads the document, follows.
func TestOpenAPISchemasMatchTypes(t *testing.T) {
	var doc struct {
		Components struct {
			Schemas map[string]struct {
				Properties map[string]json.RawMessage `json:"properties"`
			} `json:"schemas"`
		} `json:"components"`
	}
	if err := json.Unmarshal(openapi.Raw(openapi.Server), &doc); err != nil {
		t.Fatal(err)
	}
	types := map[string]any{
		"StartRequest":       server.StartRequest{},
		"Episode":            server.EpisodeView{},
		"Identity":           store.Identity{},
		"Receipt":            supervisor.Receipt{},
		"SupervisorStatus":   supervisor.Status{},
		"Verdict":            task.Verdict{},
		"VerifyResponse":     server.VerifyResponse{},
		"CheckpointRequest":  server.CheckpointRequest{},
		"EpisodeFigures":     coordinator.EpisodeFigures{},
		"CheckpointResult":   server.CheckpointResponse{},
		"CheckpointShare":    store.Share{},
		"RestoreResult":      server.RestoreResponse{},
		"RestoreRequest":     server.RestoreRequest{},
		"CheckpointProgress": server.CheckpointProgress{},
		"Restore":            store.Restore{},
		"RestoreShare":       store.RestoreShare{},
		"Checkpoint":         store.Checkpoint{},
		"Record":             store.Record{},
		"Limits":             sandbox.Limits{},
		"BranchRequest":      server.BranchRequest{},
		"Tokens":             ledger.Tokens{},
		"LedgerEntry":        ledger.Entry{},
		"LedgerEvent":        ledger.Event{},
		"Ledger":             server.LedgerResponse{},
		"LedgerProblem":      ledger.Problem{},
		"LedgerReport":       ledger.Report{},
		"TaskSummary":        server.TaskSummary{},
	}
	// Schemas that are envelopes written inline by the handlers.
	inline := map[string]bool{"Error": true, "EpisodeList": true, "CheckpointList": true, "CheckpointDetail": true, "Freed": true, "TaskList": true}
	for name, s := range doc.Components.Schemas {
		v, ok := types[name]
		if !ok {
			if !inline[name] {
				t.Errorf("schema %s: no Go type is checked against it; add it to this test", name)
			}
			continue
		}
		var want []string
		for p := range s.Properties {
			want = append(want, p)
		}
		sort.Strings(want)
		got := jsonFields(reflect.TypeOf(v))
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("schema %s has %v\nits Go type %T has %v", name, want, v, got)
		}
	}
	for name := range types {
		if _, ok := doc.Components.Schemas[name]; !ok {
			t.Errorf("the document has no schema %s", name)
		}
	}
}
