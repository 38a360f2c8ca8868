package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

const fullRecord = `{
  "schema": 1,
  "episode": "ep-1",
  "provider": "local",
  "sandbox": {"id": "sb-1", "lease": "2026-01-02T03:04:05Z", "tags": ["<a>", 1.50]},
  "snapshot_id": "snap-1",
  "keeps_processes": true,
  "pause_seq": 3,
  "pause_mode": "hold",
  "pause_confirmed": true,
  "identity": {"pid": 4017, "start_time": 196751},
  "pause_wall": 1796202673.168,
  "pause_uptime": 1967.55,
  "relay_delivered": 12,
  "harness_session": "ses_01",
  "attempt": 2,
  "deadline_left_s": 1200.5,
  "ledger_shard": {"host": "g1", "offsets": [1, 2, 3]},
  "zz_note": "kept as is"
}`

func TestRecordRoundTripKeepsUnknownFields(t *testing.T) {
	r, err := DecodeRecord([]byte(fullRecord))
	if err != nil {
		t.Fatal(err)
	}
	if r.Episode != "ep-1" || !r.KeepsProcesses || r.PauseSeq != 3 || r.PauseMode != PauseHold || r.Identity.PID != 4017 ||
		r.Identity.StartTime != 196751 || *r.PauseWall != 1796202673.168 || *r.RelayDelivered != 12 || r.Attempt != 2 {
		t.Fatalf("decoded %+v", r)
	}
	if !r.RestoresInPlace() {
		t.Fatal("a process-keeping record with identity and clocks must restore in place")
	}
	if got := r.Unknown(); !reflect.DeepEqual(got, []string{"ledger_shard", "zz_note"}) {
		t.Fatalf("unknown fields %v", got)
	}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	// Every field of the input is in the output with the same value.
	var in, out map[string]any
	if err := json.Unmarshal([]byte(fullRecord), &in); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	for k, v := range in {
		if !reflect.DeepEqual(out[k], v) {
			t.Errorf("field %q: wrote %v, read %v", k, out[k], v)
		}
	}
	if !bytes.Contains(b, []byte(`"ledger_shard":{"host":"g1","offsets":[1,2,3]}`)) {
		t.Errorf("unknown object not written back compacted and unchanged: %s", b)
	}
	r2, err := DecodeRecord(b)
	if err != nil {
		t.Fatal(err)
	}
	if !recordsEqual(r, r2) {
		t.Fatalf("round trip changed the record:\n%+v\n%+v", r, r2)
	}
	// A record made in Go, without a schema, is written as the current one.
	b, err = json.Marshal(Record{Episode: "e", Provider: "p", SnapshotID: "s"})
	if err != nil || !bytes.HasPrefix(b, []byte(`{"schema":1,`)) || !bytes.Contains(b, []byte(`"sandbox":null`)) {
		t.Fatalf("new record: %s %v", b, err)
	}
}

func TestOldRecordsReadAsBefore(t *testing.T) {
	// Written before keeps_processes, pause_wall, pause_uptime and schema.
	old := `{"episode":"ep-7","provider":"e2b","sandbox":{"id":"x"},"snapshot_id":"snap-7","pause_seq":1,"pause_mode":"stop","pause_confirmed":true,"identity":{"pid":9,"start_time":5},"attempt":0}`
	r, err := DecodeRecord([]byte(old))
	if err != nil {
		t.Fatal(err)
	}
	if r.KeepsProcesses {
		t.Error("absent keeps_processes must read as false")
	}
	if r.Schema != 1 {
		t.Errorf("absent schema reads as %d, want 1", r.Schema)
	}
	if r.RestoresInPlace() {
		t.Error("a record without keeps_processes must restore by relaunch")
	}
	// Process-keeping, but without the pause clocks: relaunch too.
	r.KeepsProcesses = true
	if r.RestoresInPlace() {
		t.Error("a record without pause_wall/pause_uptime must restore by relaunch")
	}
	w, u := 1.0, 2.0
	r.PauseWall, r.PauseUptime = &w, &u
	if !r.RestoresInPlace() {
		t.Error("with clocks and identity it restores in place")
	}
	if _, err := DecodeRecord([]byte(strings.Replace(old, `{"episode"`, `{"schema":0,"episode"`, 1))); err != nil {
		t.Errorf("schema 0 must read as 1: %v", err)
	}
}

func TestDecodeRecordRefuses(t *testing.T) {
	base := map[string]any{"schema": 1, "episode": "e", "provider": "p", "snapshot_id": "s", "pause_mode": "stop", "attempt": 0}
	with := func(k string, v any) []byte {
		m := map[string]any{}
		for kk, vv := range base {
			m[kk] = vv
		}
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
		b, _ := json.Marshal(m)
		return b
	}
	cases := []struct {
		name string
		doc  []byte
		says string
	}{
		{"newer schema", with("schema", 2), "schema 2 is newer than this stasis understands (up to 1): upgrade stasis"},
		{"negative schema", with("schema", -1), "schema -1"},
		{"no episode", with("episode", nil), `"episode" is missing`},
		{"no provider", with("provider", ""), `"provider" is missing`},
		{"no snapshot", with("snapshot_id", nil), `"snapshot_id" is missing`},
		{"bad mode", with("pause_mode", "freeze"), `"pause_mode" "freeze" is unknown`},
		{"negative attempt", with("attempt", -1), `"attempt" -1 is negative`},
		{"negative seq", with("pause_seq", -4), `"pause_seq" -4 is negative`},
		{"bad pid", with("identity", map[string]any{"pid": 0, "start_time": 1}), "pid 0"},
		{"negative wall", with("pause_wall", -1.5), `"pause_wall" -1.5`},
		{"wrong type", with("attempt", "two"), `field "attempt" must be a JSON int`},
		{"malformed", []byte(`{"episode": "e",`), "not a JSON object"},
		{"array", []byte(`[1,2]`), "not a JSON object"},
		{"null", []byte(`null`), "null"},
		{"empty", []byte{}, "not a JSON object"},
		{"trailing", []byte(`{"episode":"e"} x`), "not a JSON object"},
	}
	for _, c := range cases {
		_, err := DecodeRecord(c.doc)
		if err == nil || !errors.Is(err, ErrRecord) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %s: got %v, want an error saying %q", c.name, c.doc, err, c.says)
		}
	}
	// A finished episode needs no snapshot.
	fin := with("snapshot_id", nil)
	fin = append(fin[:len(fin)-1], []byte(`,"finished":true,"result":{"reward":1}}`)...)
	if r, err := DecodeRecord(fin); err != nil || !r.Finished || string(r.Result) != `{"reward":1}` {
		t.Errorf("finished record without snapshot: %+v %v", r, err)
	}
}

// recordsEqual compares records field by field, raw JSON values by meaning.
func recordsEqual(a, b Record) bool {
	if !jsonEqual(a.Sandbox, b.Sandbox) || !jsonEqual(a.Result, b.Result) || len(a.unknown) != len(b.unknown) {
		return false
	}
	for k, v := range a.unknown {
		w, ok := b.unknown[k]
		if !ok || !jsonEqual(v, w) {
			return false
		}
	}
	a.Sandbox, b.Sandbox, a.Result, b.Result, a.unknown, b.unknown = nil, nil, nil, nil, nil, nil
	return reflect.DeepEqual(a, b)
}

func jsonEqual(a, b json.RawMessage) bool {
	norm := func(m json.RawMessage) (any, bool) {
		if len(m) == 0 {
			return nil, true
		}
		d := json.NewDecoder(bytes.NewReader(m))
		d.UseNumber()
		var v any
		return v, d.Decode(&v) == nil
	}
	va, oka := norm(a)
	vb, okb := norm(b)
	return oka && okb && reflect.DeepEqual(va, vb)
}

func FuzzDecodeRecord(f *testing.F) {
	f.Add([]byte(fullRecord))
	f.Add([]byte(`{"episode":"e","provider":"p","snapshot_id":"s"}`))
	f.Add([]byte(`{"schema":2,"episode":"e","provider":"p","snapshot_id":"s"}`))
	f.Add([]byte(`{"episode":"e","provider":"p","finished":true,"result":null,"sandbox":null}`))
	f.Add([]byte(`{"EPISODE":"e","Provider":"p","snapshot_ID":"s","x":1,"X":2,"é":"\u00e9<>"}`))
	f.Add([]byte(`{"episode":"e","provider":"p","snapshot_id":"s","pause_wall":1e308,"identity":{"pid":1}}`))
	f.Add([]byte(`{"episode":`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRecord(b)
		if err != nil {
			return
		}
		out, err := json.Marshal(r)
		if err != nil {
			t.Fatalf("accepted %q but cannot write it: %v", b, err)
		}
		r2, err := DecodeRecord(out)
		if err != nil {
			t.Fatalf("accepted %q, wrote %s, which is refused: %v", b, out, err)
		}
		if !recordsEqual(r, r2) {
			t.Fatalf("accepted %q, wrote %s, read back a different record:\n%#v\n%#v", b, out, r, r2)
		}
		out2, err := json.Marshal(r2)
		if err != nil || !bytes.Equal(out, out2) {
			t.Fatalf("writing is not stable: %s then %s (%v)", out, out2, err)
		}
	})
}
