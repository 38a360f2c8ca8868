package golden

import (
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"
)

var (
	timeType        = reflect.TypeOf(time.Time{})
	rawType         = reflect.TypeOf(json.RawMessage{})
	marshalerType   = reflect.TypeOf((*json.Marshaler)(nil)).Elem()
	unmarshalerType = reflect.TypeOf((*json.Unmarshaler)(nil)).Elem()
	textType        = reflect.TypeOf((*encoding.TextMarshaler)(nil)).Elem()
)

// Fields checks a Go type's JSON encoding against a schema of the digest:
// every member its json tags name must be one the schema names, with a
// JSON type the schema allows, recursively into structs, slices and maps.
// It is what catches a wrong json tag on a field no test happens to read.
// A type with its own JSON methods (time.Time, and such) is taken to be a
// string. extra names members the type reads beyond the specification on
// purpose (each with its reason, at the caller).
func (s *Set) Fields(v any, schema string, extra ...string) error {
	sc, ok := s.Schemas[schema]
	if !ok {
		return fmt.Errorf("no schema %q in the digest", schema)
	}
	t := reflect.TypeOf(v)
	var errs []error
	s.fields(t, sc, t.String(), map[reflect.Type]bool{}, extra, &errs)
	return errors.Join(errs...)
}

// custom says whether a type encodes itself.
func custom(t reflect.Type) bool {
	if t == timeType {
		return true
	}
	for _, x := range []reflect.Type{t, reflect.PointerTo(t)} {
		if x.Implements(marshalerType) || x.Implements(unmarshalerType) || x.Implements(textType) {
			return true
		}
	}
	return false
}

// jsonKind is the JSON type a Go type encodes as ("" when any).
func jsonKind(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t == rawType:
		return ""
	case custom(t):
		return "string"
	}
	switch t.Kind() {
	case reflect.String:
		return "string"
	case reflect.Bool:
		return "boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integer"
	case reflect.Float32, reflect.Float64:
		return "number"
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 {
			return "string" // base64
		}
		return "array"
	case reflect.Array:
		return "array"
	case reflect.Map, reflect.Struct:
		return "object"
	}
	return ""
}

func (s *Set) fields(t reflect.Type, sc *Schema, at string, seen map[reflect.Type]bool, extra []string, errs *[]error) {
	sc = s.resolve(sc)
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if sc == nil {
		return
	}
	k := jsonKind(t)
	if k == "" {
		return
	}
	if len(sc.Type) > 0 && !contains(sc.Type, k) && !(k == "integer" && contains(sc.Type, "number")) {
		*errs = append(*errs, fmt.Errorf("%s: Go encodes a JSON %s, where the specification has %s", at, k, strings.Join(sc.Type, " or ")))
		return
	}
	if custom(t) || seen[t] && t.Kind() == reflect.Struct {
		return
	}
	switch t.Kind() {
	case reflect.Slice, reflect.Array:
		if k == "array" {
			s.fields(t.Elem(), sc.Items, at+"[]", seen, extra, errs)
		}
	case reflect.Map:
		if sc.AdditionalProperties != nil && sc.AdditionalProperties.schema != nil {
			s.fields(t.Elem(), sc.AdditionalProperties.schema, at+"[…]", seen, extra, errs)
		}
	case reflect.Struct:
		seen[t] = true
		defer delete(seen, t)
		s.structFields(t, sc, at, seen, extra, errs)
	}
}

func (s *Set) structFields(t reflect.Type, sc *Schema, at string, seen map[reflect.Type]bool, extra []string, errs *[]error) {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct && !custom(ft) {
				s.structFields(ft, sc, at, seen, extra, errs) // its fields are promoted
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		p, ok := sc.Properties[name]
		if !ok {
			if ap := sc.AdditionalProperties; ap != nil && ap.schema != nil {
				s.fields(f.Type, ap.schema, at+"."+f.Name, seen, extra, errs)
				continue
			}
			if ap := sc.AdditionalProperties; ap != nil && ap.allow || len(sc.Properties) == 0 && ap == nil || contains(extra, name) {
				continue
			}
			*errs = append(*errs, fmt.Errorf("%s.%s: json name %q is not in the specification (misspelt?); it names %s", at, f.Name, name, strings.Join(sortedKeys(sc.Properties), ", ")))
			continue
		}
		s.fields(f.Type, p, at+"."+f.Name, seen, extra, errs)
	}
}
