// Package openapi holds stasis's OpenAPI documents (one per HTTP API it
// serves) and what the tests need to check each against its handler: the
// operations a document declares.
package openapi

import (
	"embed"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
)

//go:embed *.json
var docs embed.FS

// The documents, by API.
const (
	Relay   = "relay.json"   // the relay, as the harness calls it
	Gateway = "gateway.json" // the gateway, as relays call it
	Model   = "model.json"   // the scripted model
	Server  = "server.json"  // the environment server (stasis serve)
)

// Raw returns a document's bytes (servers serve it at GET /openapi.json).
func Raw(name string) []byte {
	b, err := docs.ReadFile(name)
	if err != nil {
		panic(fmt.Sprintf("openapi: no document %s", name))
	}
	return b
}

// Operation is one method on one path, as "METHOD /path".
type Operation string

// Operations lists a document's operations, sorted.
func Operations(name string) ([]Operation, error) {
	var d struct {
		OpenAPI string                                `json:"openapi"`
		Paths   map[string]map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(Raw(name), &d); err != nil {
		return nil, fmt.Errorf("openapi %s: %w", name, err)
	}
	if !strings.HasPrefix(d.OpenAPI, "3.") {
		return nil, fmt.Errorf("openapi %s: version %q, want 3.x", name, d.OpenAPI)
	}
	var ops []Operation
	for path, methods := range d.Paths {
		for m := range methods {
			switch m {
			case "get", "post", "put", "delete", "patch":
				ops = append(ops, Operation(strings.ToUpper(m)+" "+path))
			}
		}
	}
	sort.Slice(ops, func(i, j int) bool { return ops[i] < ops[j] })
	return ops, nil
}
