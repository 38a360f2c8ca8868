package golden

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const testSchemas = `{
  "Thing": {
    "source": "test",
    "type": "object",
    "required": ["id", "state"],
    "properties": {
      "id": {"type": "string"},
      "state": {"type": "string", "enum": ["running", "paused"]},
      "at": {"type": "string", "format": "date-time"},
      "count": {"type": "integer", "minimum": 0},
      "labels": {"type": "object", "additionalProperties": {"type": "string"}},
      "domain": {"type": "string", "nullable": true},
      "data": {"type": "string", "format": "byte"},
      "items": {"type": "array", "items": {"$ref": "Item"}}
    }
  },
  "Item": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}, "additionalProperties": false},
  "Things": {"type": "array", "items": {"$ref": "Thing"}}
}`

func testSet(t *testing.T, files map[string]string) *Set {
	t.Helper()
	dir := t.TempDir()
	index := `{"thing.json": {"schema": "Thing", "source": "test"}, "things.json": {"schema": "Things", "source": "test"}}`
	for name, body := range map[string]string{IndexFile: index, SchemasFile: testSchemas} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

const goodThing = `{"id": "a", "state": "running", "at": "2030-01-02T03:04:05Z", "count": 2, "labels": {"k": "v"}, "domain": null, "data": "aGk=", "items": [{"name": "x"}]}`

func TestValidate(t *testing.T) {
	s := testSet(t, map[string]string{"thing.json": goodThing, "things.json": "[" + goodThing + "]"})
	if err := s.Validate("Thing", []byte(goodThing)); err != nil {
		t.Fatalf("a good body: %v", err)
	}
	for body, want := range map[string]string{
		`{"id": "a"}`:                                                           `"state" is missing`,
		`{"id": 1, "state": "running"}`:                                         "a JSON number",
		`{"id": "a", "state": "gone"}`:                                          "not one of",
		`{"id": "a", "state": "running", "Id": "b"}`:                            `member "Id" is not in the specification`,
		`{"id": "a", "state": "running", "at": "x"}`:                            "RFC 3339",
		`{"id": "a", "state": "running", "count": 1.5}`:                         "a JSON number",
		`{"id": "a", "state": "running", "count": -1}`:                          "below the minimum",
		`{"id": "a", "state": "running", "labels": {"k": 1}}`:                   "/labels/k",
		`{"id": "a", "state": "running", "data": "!!"}`:                         "base64",
		`{"id": "a", "state": "running", "items": [{"name": ""}]}`:              "shorter",
		`{"id": "a", "state": "running", "items": [{"name": "x", "nme": "y"}]}`: `/items/0: member "nme"`,
	} {
		err := s.Validate("Thing", []byte(body))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %q", body, err, want)
		}
	}
}

func TestLoadRefusesBadDigests(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(IndexFile, `{"a.json": {"schema": "A", "source": "s"}}`)
	write("a.json", `{}`)
	write(SchemasFile, `{"A": {"type": "object", "requried": ["x"]}}`)
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), "requried") {
		t.Errorf("a misspelt keyword: %v", err)
	}
	write(SchemasFile, `{"A": {"$ref": "B"}}`)
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), `"B"`) {
		t.Errorf("a dangling $ref: %v", err)
	}
	write(SchemasFile, `{"A": {"type": "object"}}`)
	write("b.json", `{}`)
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), "b.json is not in") {
		t.Errorf("an unindexed file: %v", err)
	}
}

func TestMatch(t *testing.T) {
	want := `{"id": "a", "n": 3, "meta": {"x/y": "1", "z": "2"}, "list": [{"t": "p"}, {"t": "q"}]}`
	vol := map[string]string{"/id": AnyString, "/meta/x~1y": AnyString, "/list/*/t": AnyString}
	if err := Match([]byte(`{"id": "b", "n": 3.0, "meta": {"x/y": "9", "z": "2"}, "list": [{"t": "r"}, {"t": "s"}]}`), []byte(want), vol); err != nil {
		t.Fatalf("a matching body: %v", err)
	}
	for got, msg := range map[string]string{
		`{"id": "a", "n": 3, "meta": {"x/y": "1", "z": "3"}, "list": [{"t": "p"}, {"t": "q"}]}`:             `/meta/z: "3"`,
		`{"id": "a", "n": 3, "meta": {"x/y": "1", "z": "2"}, "list": [{"t": "p"}, {"t": "q"}], "extra": 1}`: `"extra"`,
		`{"id": 7, "n": 3, "meta": {"x/y": "1", "z": "2"}, "list": [{"t": "p"}, {"t": "q"}]}`:               "/id: a JSON number",
		`{"n": 3, "meta": {"x/y": "1", "z": "2"}, "list": [{"t": "p"}, {"t": "q"}]}`:                        `"id" is missing`,
		`{"id": "a", "n": 3, "meta": {"x/y": "1", "z": "2"}, "list": [{"t": "p"}]}`:                         "1 items",
	} {
		if err := Match([]byte(got), []byte(want), vol); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%s: %v, want an error saying %q", got, err, msg)
		}
	}
}

func TestShape(t *testing.T) {
	s := testSet(t, map[string]string{"thing.json": goodThing, "things.json": "[" + goodThing + "]"})
	if err := s.Shape("things.json", []byte(`[{"id": "z", "state": "paused"}, {"id": "y", "state": "running", "count": 9}]`)); err != nil {
		t.Fatalf("a good shape: %v", err)
	}
	if err := s.Shape("things.json", []byte(`[{"id": "z"}]`)); err == nil || !strings.Contains(err.Error(), `"state"`) {
		t.Errorf("a missing required member: %v", err)
	}
	if err := s.Shape("thing.json", []byte(`{"id": "z", "state": "paused", "stat": "x"}`)); err == nil || !strings.Contains(err.Error(), `"stat"`) {
		t.Errorf("a misspelt member: %v", err)
	}
}

func TestFields(t *testing.T) {
	s := testSet(t, map[string]string{"thing.json": goodThing, "things.json": "[" + goodThing + "]"})
	type item struct {
		Name string `json:"name"`
	}
	type base struct {
		ID string `json:"id"`
	}
	type good struct {
		base
		State  string            `json:"state"`
		At     time.Time         `json:"at"`
		Count  *int32            `json:"count,omitempty"`
		Labels map[string]string `json:"labels"`
		Data   []byte            `json:"data"`
		Items  []item            `json:"items"`
		Gone   int               `json:"-"`
	}
	if err := s.Fields(good{}, "Thing"); err != nil {
		t.Fatalf("a good type: %v", err)
	}
	type badTag struct {
		ID    string `json:"Id"`
		State string `json:"state"`
	}
	if err := s.Fields(badTag{}, "Thing"); err == nil || !strings.Contains(err.Error(), `"Id"`) {
		t.Errorf("a wrong tag: %v", err)
	}
	type badType struct {
		ID    int    `json:"id"`
		State string `json:"state"`
	}
	if err := s.Fields(badType{}, "Thing"); err == nil || !strings.Contains(err.Error(), "JSON integer") {
		t.Errorf("a wrong type: %v", err)
	}
	type badItem struct {
		Items []struct {
			Nme string `json:"nme"`
		} `json:"items"`
	}
	if err := s.Fields(badItem{}, "Thing"); err == nil || !strings.Contains(err.Error(), `"nme"`) {
		t.Errorf("a wrong tag in an item: %v", err)
	}
}
