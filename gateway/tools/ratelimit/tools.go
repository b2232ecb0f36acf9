//go:build tools

// Package tools records the rate-limit service as a dependency of this module, so `go mod tidy` keeps go.sum whole.
package tools

import _ "github.com/envoyproxy/ratelimit/src/service_cmd/runner"
