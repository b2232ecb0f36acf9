//go:build tools

// Package tools records Jaeger as a dependency of this module, so `go mod tidy` keeps go.sum whole.
package tools

import _ "github.com/jaegertracing/jaeger/cmd/jaeger"
