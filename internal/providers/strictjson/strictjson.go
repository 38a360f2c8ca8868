// Package strictjson owns decoding JSON request bodies the way the services
// the fakes stand for read them, where Go's encoding/json is laxer: member
// names matched exactly, not in any letter case. A fake that took
// "templateId" for "templateID" (as encoding/json does) would let a client's
// misspelt JSON tag pass every test run against it. It is a leaf: it
// imports nothing of stasis.
package strictjson

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
)

// Unmarshal decodes JSON into v as encoding/json does, but refuses a member
// whose name matches one of v's (a json tag, or a field's name) only when
// letter case is ignored, at any depth of structs, slices and maps.
func Unmarshal(b []byte, v any) error {
	if err := json.Unmarshal(b, v); err != nil {
		return err
	}
	var raw any
	if err := json.Unmarshal(b, &raw); err != nil {
		return err
	}
	return exactNames(raw, reflect.TypeOf(v), "")
}

// names are the JSON names of a struct's fields, embedded structs'
// promoted.
func names(t reflect.Type, into map[string]reflect.Type) {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if f.Anonymous && name == "" && ft.Kind() == reflect.Struct {
			names(ft, into)
			continue
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		into[name] = f.Type
	}
}

func exactNames(raw any, t reflect.Type, at string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch x := raw.(type) {
	case map[string]any:
		switch t.Kind() {
		case reflect.Map:
			for k, e := range x {
				if err := exactNames(e, t.Elem(), at+"."+k); err != nil {
					return err
				}
			}
		case reflect.Struct:
			known := map[string]reflect.Type{}
			names(t, known)
			for k, e := range x {
				if ft, ok := known[k]; ok {
					if err := exactNames(e, ft, at+"."+k); err != nil {
						return err
					}
					continue
				}
				for name := range known {
					if strings.EqualFold(name, k) {
						return fmt.Errorf("member %q is not in the specification, which names it %q", strings.TrimPrefix(at+"."+k, "."), name)
					}
				}
			}
		}
	case []any:
		if t.Kind() == reflect.Slice || t.Kind() == reflect.Array {
			for i, e := range x {
				if err := exactNames(e, t.Elem(), fmt.Sprintf("%s[%d]", at, i)); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
