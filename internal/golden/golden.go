// Package golden owns holding a client and a fake server to the wire format
// a specification gives, rather than to each other: a directory of golden
// request and response bodies transcribed by hand from the specification's
// schemas and examples, an index naming each file's schema and where in the
// specification it comes from, and a digest of those schemas (a small
// subset of JSON Schema, also by hand). It checks a body against a schema
// (JSON types, required members, enums, formats, and no member the
// specification does not name, which is how a misspelt key shows), a
// request against its golden body (volatile members checked for their type
// only), and a response against the shape of a golden one. It is a leaf: it
// imports nothing of stasis.
package golden

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Index and schema files of a golden directory.
const (
	IndexFile   = "index.json"
	SchemasFile = "schemas.json"
)

// Entry is a golden file's line in the index.
type Entry struct {
	// Schema names the file's schema in schemas.json.
	Schema string `json:"schema"`
	// Source says where in the specification the file comes from.
	Source string `json:"source"`
}

// Schema is the subset of JSON Schema (and of OpenAPI's dialect) that the
// digests use. An object schema with properties and no
// additionalProperties is closed: a member it does not name is an error.
type Schema struct {
	Source      string `json:"source,omitempty"`
	Description string `json:"description,omitempty"`
	// Ref names another schema of the same digest.
	Ref        string             `json:"$ref,omitempty"`
	Type       types              `json:"type,omitempty"`
	Nullable   bool               `json:"nullable,omitempty"`
	Properties map[string]*Schema `json:"properties,omitempty"`
	Required   []string           `json:"required,omitempty"`
	// AdditionalProperties: absent, true (anything), false (nothing) or a
	// schema for every member not in Properties.
	AdditionalProperties *additional `json:"additionalProperties,omitempty"`
	Items                *Schema     `json:"items,omitempty"`
	Enum                 []any       `json:"enum,omitempty"`
	// Format: "date-time" (RFC 3339) or "byte" (standard base64).
	Format    string   `json:"format,omitempty"`
	Minimum   *float64 `json:"minimum,omitempty"`
	MinLength *int     `json:"minLength,omitempty"`
	MinItems  *int     `json:"minItems,omitempty"`
}

// types is a schema's "type": one name or a list.
type types []string

func (t *types) UnmarshalJSON(b []byte) error {
	var one string
	if json.Unmarshal(b, &one) == nil {
		*t = types{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return fmt.Errorf("type must be a name or a list of names: %s", b)
	}
	*t = many
	return nil
}

// additional is additionalProperties: a boolean or a schema.
type additional struct {
	allow  bool
	schema *Schema
}

func (a *additional) UnmarshalJSON(b []byte) error {
	if string(b) == "true" || string(b) == "false" {
		a.allow = string(b) == "true"
		return nil
	}
	s, err := decodeSchema(b)
	if err != nil {
		return err
	}
	a.allow, a.schema = true, s
	return nil
}

func decodeSchema(b []byte) (*Schema, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields() // a misspelt keyword in a digest is an error, not a schema that checks nothing
	var s Schema
	if err := dec.Decode(&s); err != nil {
		return nil, err
	}
	return &s, nil
}

// Set is one golden directory.
type Set struct {
	Dir     string
	Files   map[string]Entry
	Schemas map[string]*Schema
}

// Load reads a golden directory: its index and its schema digest. Every
// schema a file or a $ref names must be in the digest, every indexed file
// must exist, and every .json file must be indexed.
func Load(dir string) (*Set, error) {
	s := &Set{Dir: dir}
	b, err := os.ReadFile(filepath.Join(dir, IndexFile))
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&s.Files); err != nil {
		return nil, fmt.Errorf("%s: %w", IndexFile, err)
	}
	if b, err = os.ReadFile(filepath.Join(dir, SchemasFile)); err != nil {
		return nil, err
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("%s: %w", SchemasFile, err)
	}
	s.Schemas = map[string]*Schema{}
	for name, r := range raw {
		sc, err := decodeSchema(r)
		if err != nil {
			return nil, fmt.Errorf("%s: schema %s: %w", SchemasFile, name, err)
		}
		s.Schemas[name] = sc
	}
	var errs []error
	for name, sc := range s.Schemas {
		s.refs(sc, "schema "+name, &errs)
	}
	for name, e := range s.Files {
		if _, ok := s.Schemas[e.Schema]; !ok {
			errs = append(errs, fmt.Errorf("%s: file %s names schema %q, which %s lacks", IndexFile, name, e.Schema, SchemasFile))
		}
		if e.Source == "" {
			errs = append(errs, fmt.Errorf("%s: file %s names no source", IndexFile, name))
		}
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", IndexFile, err))
		}
	}
	all, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	for _, p := range all {
		name := filepath.Base(p)
		if _, ok := s.Files[name]; !ok && name != IndexFile && name != SchemasFile {
			errs = append(errs, fmt.Errorf("%s is not in %s", name, IndexFile))
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return s, nil
}

func (s *Set) refs(sc *Schema, at string, errs *[]error) {
	if sc == nil {
		return
	}
	if sc.Ref != "" {
		if _, ok := s.Schemas[sc.Ref]; !ok {
			*errs = append(*errs, fmt.Errorf("%s: $ref %q is not in %s", at, sc.Ref, SchemasFile))
		}
	}
	for k, p := range sc.Properties {
		s.refs(p, at+"."+k, errs)
	}
	if sc.AdditionalProperties != nil {
		s.refs(sc.AdditionalProperties.schema, at+".*", errs)
	}
	s.refs(sc.Items, at+"[]", errs)
}

// Read returns a golden file's bytes.
func (s *Set) Read(name string) ([]byte, error) {
	if _, ok := s.Files[name]; !ok {
		return nil, fmt.Errorf("%s is not a golden file of %s", name, s.Dir)
	}
	return os.ReadFile(filepath.Join(s.Dir, name))
}

// SchemaOf is the schema of a golden file.
func (s *Set) SchemaOf(name string) string { return s.Files[name].Schema }

// resolve follows $ref.
func (s *Set) resolve(sc *Schema) *Schema {
	for i := 0; sc != nil && sc.Ref != "" && i < 32; i++ {
		sc = s.Schemas[sc.Ref]
	}
	return sc
}

// decode reads one JSON value, numbers kept as written.
func decode(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("more than one JSON value")
	}
	return v, nil
}

// kind is a JSON value's type: object, array, string, number, boolean or
// null.
func kind(v any) string {
	switch v.(type) {
	case map[string]any:
		return "object"
	case []any:
		return "array"
	case string:
		return "string"
	case json.Number:
		return "number"
	case bool:
		return "boolean"
	case nil:
		return "null"
	}
	return fmt.Sprintf("%T", v)
}

func isInteger(n json.Number) bool {
	_, err := strconv.ParseInt(string(n), 10, 64)
	return err == nil
}

func ptr(at, key string) string {
	return at + "/" + strings.NewReplacer("~", "~0", "/", "~1").Replace(key)
}

func where(at string) string {
	if at == "" {
		return "(the body)"
	}
	return at
}

// Validate checks a JSON body against a schema of the digest: every
// problem is in the error, one per line, at its JSON pointer.
func (s *Set) Validate(schema string, body []byte) error {
	sc, ok := s.Schemas[schema]
	if !ok {
		return fmt.Errorf("no schema %q in %s", schema, filepath.Join(s.Dir, SchemasFile))
	}
	v, err := decode(body)
	if err != nil {
		return fmt.Errorf("not JSON: %w", err)
	}
	var errs []error
	s.validate(sc, v, "", &errs)
	return errors.Join(errs...)
}

func (s *Set) validate(sc *Schema, v any, at string, errs *[]error) {
	sc = s.resolve(sc)
	if sc == nil {
		return
	}
	fail := func(format string, args ...any) {
		*errs = append(*errs, fmt.Errorf("%s: %s", where(at), fmt.Sprintf(format, args...)))
	}
	k := kind(v)
	if k == "null" && (sc.Nullable || len(sc.Type) == 0 || contains(sc.Type, "null")) {
		return
	}
	if len(sc.Type) > 0 {
		ok := contains(sc.Type, k) || k == "number" && contains(sc.Type, "integer") && isInteger(v.(json.Number))
		if !ok {
			fail("a JSON %s %s, where the specification has %s", k, short(v), strings.Join(sc.Type, " or "))
			return
		}
	}
	if len(sc.Enum) > 0 {
		found := false
		for _, e := range sc.Enum {
			if fmt.Sprint(e) == fmt.Sprint(v) {
				found = true
			}
		}
		if !found {
			fail("%s is not one of %v", short(v), sc.Enum)
		}
	}
	switch x := v.(type) {
	case string:
		if sc.MinLength != nil && len([]rune(x)) < *sc.MinLength {
			fail("%q is shorter than %d", x, *sc.MinLength)
		}
		switch sc.Format {
		case "date-time":
			if _, err := time.Parse(time.RFC3339Nano, x); err != nil {
				fail("%q is not an RFC 3339 date-time", x)
			}
		case "byte":
			if _, err := base64.StdEncoding.DecodeString(x); err != nil {
				fail("%q is not standard base64", x)
			}
		}
	case json.Number:
		if sc.Minimum != nil {
			if f, err := x.Float64(); err == nil && f < *sc.Minimum {
				fail("%s is below the minimum %v", x, *sc.Minimum)
			}
		}
	case []any:
		if sc.MinItems != nil && len(x) < *sc.MinItems {
			fail("%d items, fewer than %d", len(x), *sc.MinItems)
		}
		for i, it := range x {
			s.validate(sc.Items, it, at+"/"+strconv.Itoa(i), errs)
		}
	case map[string]any:
		for _, r := range sc.Required {
			if _, ok := x[r]; !ok {
				fail("the required member %q is missing", r)
			}
		}
		for _, key := range sortedKeys(x) {
			if p, ok := sc.Properties[key]; ok {
				s.validate(p, x[key], ptr(at, key), errs)
				continue
			}
			switch ap := sc.AdditionalProperties; {
			case ap != nil && ap.schema != nil:
				s.validate(ap.schema, x[key], ptr(at, key), errs)
			case ap != nil && !ap.allow, ap == nil && len(sc.Properties) > 0:
				fail("member %q is not in the specification (misspelt?); it names %s", key, strings.Join(sortedKeys(sc.Properties), ", "))
			}
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func short(v any) string {
	b, _ := json.Marshal(v)
	if len(b) > 80 {
		return string(b[:80]) + "…"
	}
	return string(b)
}

// Volatile types for Match: a member that must be there with this type,
// whatever its value. "date-time" is a string holding an RFC 3339 time.
const (
	AnyString   = "string"
	AnyNumber   = "number"
	AnyInteger  = "integer"
	AnyBoolean  = "boolean"
	AnyObject   = "object"
	AnyArray    = "array"
	AnyDateTime = "date-time"
)

// Match compares a JSON body with a golden one: the same members with the
// same values, except those at the volatile JSON pointers, which need only
// be there with the type given. A pointer's segment "*" stands for any key
// or index.
func Match(got, want []byte, volatile map[string]string) error {
	g, err := decode(got)
	if err != nil {
		return fmt.Errorf("not JSON: %w: %s", err, got)
	}
	w, err := decode(want)
	if err != nil {
		return fmt.Errorf("the golden body is not JSON: %w", err)
	}
	var errs []error
	seen := map[string]bool{}
	match(g, w, "", volatile, seen, &errs)
	for p := range volatile {
		if !seen[p] {
			errs = append(errs, fmt.Errorf("%s: a volatile member that is not there", p))
		}
	}
	return errors.Join(errs...)
}

// volatileAt finds the volatile pattern that matches a pointer.
func volatileAt(at string, volatile map[string]string) (string, bool) {
	if _, ok := volatile[at]; ok {
		return at, true
	}
	segs := strings.Split(at, "/")
	for p := range volatile {
		ps := strings.Split(p, "/")
		if len(ps) != len(segs) {
			continue
		}
		ok := true
		for i := range ps {
			if ps[i] != "*" && ps[i] != segs[i] {
				ok = false
				break
			}
		}
		if ok {
			return p, true
		}
	}
	return "", false
}

func match(g, w any, at string, volatile map[string]string, seen map[string]bool, errs *[]error) {
	fail := func(format string, args ...any) {
		*errs = append(*errs, fmt.Errorf("%s: %s", where(at), fmt.Sprintf(format, args...)))
	}
	if p, ok := volatileAt(at, volatile); ok {
		seen[p] = true
		want := volatile[p]
		switch {
		case want == AnyDateTime:
			s, ok := g.(string)
			if _, err := time.Parse(time.RFC3339Nano, s); !ok || err != nil {
				fail("%s, where an RFC 3339 date-time belongs", short(g))
			}
		case want == AnyInteger:
			n, ok := g.(json.Number)
			if !ok || !isInteger(n) {
				fail("%s, where an integer belongs", short(g))
			}
		case kind(g) != want:
			fail("a JSON %s %s, where a %s belongs", kind(g), short(g), want)
		}
		return
	}
	if kind(g) != kind(w) {
		fail("a JSON %s %s, where the golden body has the %s %s", kind(g), short(g), kind(w), short(w))
		return
	}
	switch wv := w.(type) {
	case map[string]any:
		gv := g.(map[string]any)
		for _, k := range sortedKeys(wv) {
			if _, ok := gv[k]; !ok {
				fail("member %q is missing (the golden body has %s)", k, short(wv[k]))
				continue
			}
			match(gv[k], wv[k], ptr(at, k), volatile, seen, errs)
		}
		for _, k := range sortedKeys(gv) {
			if _, ok := wv[k]; !ok {
				fail("member %q (%s) is not in the golden body", k, short(gv[k]))
			}
		}
	case []any:
		gv := g.([]any)
		if len(gv) != len(wv) {
			fail("%d items, where the golden body has %d: %s", len(gv), len(wv), short(g))
			return
		}
		for i := range wv {
			match(gv[i], wv[i], at+"/"+strconv.Itoa(i), volatile, seen, errs)
		}
	case json.Number:
		// 1 and 1.0 are the same number on the wire.
		gf, _ := g.(json.Number).Float64()
		wf, _ := wv.Float64()
		if gf != wf {
			fail("%s, where the golden body has %s", g, wv)
		}
	default:
		if g != w {
			fail("%s, where the golden body has %s", short(g), short(w))
		}
	}
}

// Shape checks a response body against a golden file's shape: it must
// validate against the file's schema, and every member the golden body
// has that the schema requires (recursively; in arrays, against the golden
// body's first item) must be there with the same JSON type. Values may
// differ.
func (s *Set) Shape(name string, got []byte) error {
	e, ok := s.Files[name]
	if !ok {
		return fmt.Errorf("%s is not a golden file of %s", name, s.Dir)
	}
	want, err := s.Read(name)
	if err != nil {
		return err
	}
	errs := []error{}
	if err := s.Validate(e.Schema, got); err != nil {
		errs = append(errs, err)
	}
	g, err := decode(got)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	w, err := decode(want)
	if err != nil {
		return fmt.Errorf("golden %s: %w", name, err)
	}
	s.shape(s.Schemas[e.Schema], g, w, "", &errs)
	return errors.Join(errs...)
}

func (s *Set) shape(sc *Schema, g, w any, at string, errs *[]error) {
	sc = s.resolve(sc)
	if sc == nil {
		return
	}
	fail := func(format string, args ...any) {
		*errs = append(*errs, fmt.Errorf("%s: %s", where(at), fmt.Sprintf(format, args...)))
	}
	switch wv := w.(type) {
	case map[string]any:
		gv, ok := g.(map[string]any)
		if !ok {
			fail("a JSON %s, where the golden body has an object", kind(g))
			return
		}
		for _, k := range sc.Required {
			wm, inW := wv[k]
			gm, inG := gv[k]
			switch {
			case !inW:
			case !inG:
				fail("the required member %q is missing (the golden body has %s)", k, short(wm))
			case kind(gm) != kind(wm):
				fail("the required member %q is a JSON %s, where the golden body has a %s", k, kind(gm), kind(wm))
			default:
				s.shape(sc.Properties[k], gm, wm, ptr(at, k), errs)
			}
		}
	case []any:
		gv, ok := g.([]any)
		if !ok {
			fail("a JSON %s, where the golden body has an array", kind(g))
			return
		}
		if len(wv) == 0 {
			return
		}
		for i, it := range gv {
			s.shape(sc.Items, it, wv[0], at+"/"+strconv.Itoa(i), errs)
		}
	}
}
